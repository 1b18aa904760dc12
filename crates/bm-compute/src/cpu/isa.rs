//! Which instruction set the CPU kernels run with: the one place that
//! decides it.
//!
//! The release build targets the architecture's baseline (SSE2 on x86-64),
//! so a binary runs on any machine; the kernels that matter (matrix-vector
//! and matrix products, quantized products, attention) are compiled a
//! second and third time with `#[target_feature]` and one of them is
//! chosen at run time, as llama.cpp's ggml-cpu does. [`Isa::active`] is
//! detected once per process; `BM_CPU_ISA` (`portable`, `avx2`, `avx512`,
//! `avx512bf16`, `neon`) lowers it, to compare kernels on one machine or
//! to reproduce another machine's results. Tests run each kernel with
//! every level of [`Isa::supported`] in turn.

use std::sync::OnceLock;

/// An instruction-set level, in increasing order of what it may use.
/// Each x86 level includes the ones below it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Plain Rust for the build's baseline, which the compiler vectorises
    /// as it can: the reference the others are tested against, and what
    /// runs on CPUs the kernels were not written for.
    Portable,
    /// aarch64 Advanced SIMD (always present there), with FMA and f16
    /// conversions.
    Neon,
    /// x86-64 AVX2 with FMA and F16C (Haswell, Zen 1 and later).
    Avx2,
    /// x86-64 AVX-512 F, BW, DQ and VL (Skylake-SP, Ice Lake, Zen 4).
    Avx512,
    /// AVX-512 with the VNNI integer and BF16 dot products
    /// (`vpdpbusd`, `vdpbf16ps`: Cooper Lake, Sapphire Rapids, Zen 4).
    Avx512Bf16,
}

impl Isa {
    /// Every level, in order.
    pub const ALL: [Isa; 5] = [
        Isa::Portable,
        Isa::Neon,
        Isa::Avx2,
        Isa::Avx512,
        Isa::Avx512Bf16,
    ];

    /// The name `BM_CPU_ISA` takes and reports print.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Neon => "neon",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512bf16",
        }
    }

    /// The level named `name`, if any.
    pub fn from_name(name: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|isa| isa.name() == name)
    }

    /// True when this CPU can run kernels of this level.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Portable => true,
            Isa::Neon => cfg!(target_arch = "aarch64"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.is_supported()
                    && std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512dq")
                    && std::arch::is_x86_feature_detected!("avx512vl")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Bf16 => {
                Isa::Avx512.is_supported()
                    && std::arch::is_x86_feature_detected!("avx512vnni")
                    && std::arch::is_x86_feature_detected!("avx512bf16")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512 | Isa::Avx512Bf16 => false,
        }
    }

    /// True when this level's bf16 dot product (`vdpbf16ps`) multiplies
    /// bf16 weights by bf16 inputs faster than widening the weights to f32
    /// for FMA: on AMD's cores (Zen 4 runs a 512-bit FMA as two 256-bit
    /// halves, while `vdpbf16ps` does twice its multiply-adds at the same
    /// rate), not on Intel's, whose two 512-bit FMA units outrun it (a
    /// 64-row product 1.3-1.4× slower with it on a Xeon with AVX-512 BF16).
    /// Decided by the CPU's vendor, not by timing, so a machine gives the
    /// same results in every run (the two paths round differently).
    pub fn bf16_dot_pays(self) -> bool {
        self >= Isa::Avx512Bf16 && cpu_vendor() == *b"AuthenticAMD"
    }

    /// Every level this CPU can run, lowest first: what tests force on in
    /// turn.
    pub fn supported() -> Vec<Isa> {
        Isa::ALL
            .into_iter()
            .filter(|isa| isa.is_supported())
            .collect()
    }

    /// The best level this CPU runs.
    pub fn detected() -> Isa {
        *Isa::supported()
            .last()
            .expect("portable is always supported")
    }

    /// The level the kernels use: [`Isa::detected`], or `BM_CPU_ISA` when
    /// it names a supported level (an unknown or unsupported name is
    /// ignored, so a script written for another machine still runs).
    /// Decided once per process.
    pub fn active() -> Isa {
        static ACTIVE: OnceLock<Isa> = OnceLock::new();
        *ACTIVE.get_or_init(|| {
            std::env::var("BM_CPU_ISA")
                .ok()
                .and_then(|name| Isa::from_name(name.trim()))
                .filter(|isa| isa.is_supported())
                .unwrap_or_else(Isa::detected)
        })
    }
}

/// The CPU vendor's name as CPUID leaf 0 gives it (zeros off x86-64).
fn cpu_vendor() -> [u8; 12] {
    #[cfg(target_arch = "x86_64")]
    {
        let leaf = std::arch::x86_64::__cpuid(0);
        let mut name = [0u8; 12];
        name[..4].copy_from_slice(&leaf.ebx.to_le_bytes());
        name[4..8].copy_from_slice(&leaf.edx.to_le_bytes());
        name[8..].copy_from_slice(&leaf.ecx.to_le_bytes());
        name
    }
    #[cfg(not(target_arch = "x86_64"))]
    [0u8; 12]
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_are_ordered_named_and_portable_is_always_there() {
        for isa in Isa::ALL {
            assert_eq!(Isa::from_name(isa.name()), Some(isa));
        }
        let supported = Isa::supported();
        assert_eq!(supported[0], Isa::Portable);
        assert!(supported.windows(2).all(|w| w[0] < w[1]));
        assert!(supported.contains(&Isa::active()));
        assert!(Isa::active() <= Isa::detected());
        assert_eq!(Isa::from_name("sse9"), None);
    }
}
