//! The bitsandbytes formats: the 4-bit code tables (NF4, FP4) and how a
//! value is rounded to them, the 8-bit "dynamic" map that double
//! quantization stores block scales in, and the block sizes bitsandbytes
//! accepts.
//!
//! Every constant here is bitsandbytes' (v0.50, `functional.py` and
//! `backends/default/ops.py`), kept bit for bit: checkpoints store
//! `quant_map` / `nested_quant_map` and we check them against these.

use std::sync::LazyLock;

use bm_tensor::DType;

use crate::Error;

/// Which 4-bit data type a weight is quantized to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FourBitType {
    /// NormalFloat4 (QLoRA): 16 quantiles of N(0, 1), scaled to [-1, 1].
    Nf4,
    /// bitsandbytes' FP4: 1 sign, 2 exponent, 1 mantissa bit, scaled to [-1, 1].
    Fp4,
}

/// NF4's 16 values (`get_4bit_type("nf4")`), sorted. bitsandbytes'
/// decimal literals, kept digit for digit (they round to these f32 values).
#[allow(clippy::excessive_precision)]
const NF4: [f32; 16] = [
    -1.0,
    -0.696_192_800_998_687_7,
    -0.525_073_051_452_636_7,
    -0.394_917_488_098_144_53,
    -0.284_441_381_692_886_35,
    -0.184_773_430_228_233_34,
    -0.091_050_036_251_544_95,
    0.0,
    0.079_580_299_556_255_34,
    0.160_930_201_411_247_25,
    0.246_112_301_945_686_34,
    0.337_915_241_718_292_24,
    0.440_709_829_330_444_34,
    0.562_617_003_917_694_1,
    0.722_956_836_223_602_3,
    1.0,
];

/// FP4's values before scaling, in bit-pattern order (`get_4bit_type("fp4")`
/// divides them by 12 in f32). Entry 8 is +0: the Python list has an
/// integer `-0`.
const FP4_UNSCALED: [f32; 16] = [
    0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, 0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0,
];

impl FourBitType {
    /// The name bitsandbytes uses (`quant_type`, and the suffix of the
    /// `quant_state.bitsandbytes__*` entry).
    pub fn name(self) -> &'static str {
        match self {
            FourBitType::Nf4 => "nf4",
            FourBitType::Fp4 => "fp4",
        }
    }

    /// The type called `name` (`nf4`, `fp4`).
    pub fn from_name(name: &str) -> Result<FourBitType, Error> {
        match name {
            "nf4" => Ok(FourBitType::Nf4),
            "fp4" => Ok(FourBitType::Fp4),
            other => Err(Error::UnsupportedQuant(format!(
                "4-bit quant type {other:?} (bitsandbytes has nf4 and fp4)"
            ))),
        }
    }

    /// The 16 values a 4-bit code stands for, indexed by code: the
    /// `quant_map` bitsandbytes stores and dequantizes with.
    pub fn code(self) -> [f32; 16] {
        match self {
            FourBitType::Nf4 => NF4,
            FourBitType::Fp4 => FP4_UNSCALED.map(|v| v / 12.0),
        }
    }

    /// For each byte, the values of its high and low nibble: how the
    /// matmul decodes two codes with one load.
    pub(crate) fn byte_pairs(self) -> &'static [[f32; 2]; 256] {
        fn table(kind: FourBitType) -> [[f32; 2]; 256] {
            let code = kind.code();
            std::array::from_fn(|b| [code[b >> 4], code[b & 0xF]])
        }
        static NF4_PAIRS: LazyLock<[[f32; 2]; 256]> = LazyLock::new(|| table(FourBitType::Nf4));
        static FP4_PAIRS: LazyLock<[[f32; 2]; 256]> = LazyLock::new(|| table(FourBitType::Fp4));
        match self {
            FourBitType::Nf4 => &NF4_PAIRS,
            FourBitType::Fp4 => &FP4_PAIRS,
        }
    }

    /// What quantizing needs (bitsandbytes' `_get_4bit_quantize_bounds`):
    /// the midpoints between neighbouring values in ascending order, and
    /// for each rank the code of that value. A scaled value `v` gets the
    /// code `order[i]` where `i` counts the midpoints below `v`
    /// (`torch.bucketize`, ties going down).
    pub(crate) fn quantize_table(self) -> ([f32; 15], [u8; 16]) {
        let code = self.code();
        let mut order: [u8; 16] = std::array::from_fn(|i| i as u8);
        // Stable, as torch.argsort on the CPU: FP4's two zeros keep their
        // order (code 0 first, then code 8).
        order.sort_by(|&a, &b| code[a as usize].total_cmp(&code[b as usize]));
        let bounds =
            std::array::from_fn(|i| (code[order[i] as usize] + code[order[i + 1] as usize]) / 2.0);
        (bounds, order)
    }
}

/// Block sizes `quantize_4bit` accepts.
pub const FOUR_BIT_BLOCK_SIZES: [usize; 8] = [32, 64, 128, 256, 512, 1024, 2048, 4096];

/// The block size of double quantization's second level: bitsandbytes
/// always uses 256, and its matmul refuses any other.
pub const NESTED_BLOCK_SIZE: usize = 256;

/// Checks a 4-bit block size against bitsandbytes' list.
pub fn check_four_bit_block_size(blocksize: usize) -> Result<(), Error> {
    if FOUR_BIT_BLOCK_SIZES.contains(&blocksize) {
        Ok(())
    } else {
        Err(Error::UnsupportedQuant(format!(
            "4-bit block size {blocksize} (bitsandbytes accepts {FOUR_BIT_BLOCK_SIZES:?})"
        )))
    }
}

/// bitsandbytes' signed 8-bit "dynamic" map (`create_dynamic_map()`), as
/// float32 bit patterns: what double quantization rounds block scales to.
/// It is data, not derived here, because bitsandbytes builds it with
/// `torch.linspace` in float32, whose rounding no closed formula matches;
/// checkpoints carry their own copy (`nested_quant_map`), which is what
/// dequantization uses.
const DYNAMIC_MAP_BITS: [u32; 256] = [
    0xbf7e3333, 0xbf7a999a, 0xbf770000, 0xbf736666, 0xbf6fcccd, 0xbf6c3333, 0xbf68999a, 0xbf650000,
    0xbf616666, 0xbf5dcccd, 0xbf5a3333, 0xbf56999a, 0xbf530000, 0xbf4f6666, 0xbf4bcccd, 0xbf483333,
    0xbf44999a, 0xbf410000, 0xbf3d6666, 0xbf39cccd, 0xbf363334, 0xbf32999a, 0xbf2f0000, 0xbf2b6666,
    0xbf27cccd, 0xbf243334, 0xbf20999a, 0xbf1d0000, 0xbf196666, 0xbf15cccd, 0xbf123334, 0xbf0e999a,
    0xbf0b0000, 0xbf076666, 0xbf03cccc, 0xbf003333, 0xbef93332, 0xbef20000, 0xbeeacccc, 0xbee3999a,
    0xbedc6666, 0xbed53333, 0xbece0000, 0xbec6cccc, 0xbebf999a, 0xbeb86666, 0xbeb13333, 0xbeaa0000,
    0xbea2cccc, 0xbe9b999a, 0xbe946666, 0xbe8d3334, 0xbe860000, 0xbe7d9999, 0xbe6f3333, 0xbe60cccd,
    0xbe526666, 0xbe440000, 0xbe35999a, 0xbe273333, 0xbe18cccd, 0xbe0a6666, 0xbdf80000, 0xbddb3334,
    0xbdc9eb85, 0xbdc428f7, 0xbdbe6667, 0xbdb8a3d7, 0xbdb2e148, 0xbdad1eb8, 0xbda75c2a, 0xbda1999a,
    0xbd9bd70a, 0xbd96147b, 0xbd9051eb, 0xbd8a8f5d, 0xbd84cccd, 0xbd7e147b, 0xbd728f5d, 0xbd670a3d,
    0xbd5b851f, 0xbd500000, 0xbd447ae1, 0xbd38f5c3, 0xbd2d70a3, 0xbd21eb85, 0xbd166667, 0xbd0ae148,
    0xbcfeb852, 0xbce7ae15, 0xbcd0a3d7, 0xbcb9999a, 0xbca28f5d, 0xbc8b851f, 0xbc68f5c3, 0xbc3ae148,
    0xbc1f3b64, 0xbc160418, 0xbc0ccccd, 0xbc039581, 0xbbf4bc6a, 0xbbe24dd3, 0xbbcfdf3b, 0xbbbd70a4,
    0xbbab020d, 0xbb989374, 0xbb8624dd, 0xbb676c8a, 0xbb428f5c, 0xbb1db22d, 0xbaf1a9fc, 0xbaa7ef9d,
    0xba7765ff, 0xba59e83e, 0xba3c6a80, 0xba1eecc1, 0xba016f01, 0xb9c7e283, 0xb98ce705, 0xb923d70b,
    0xb8ba1f4b, 0xb88aefb3, 0xb8378034, 0xb7b24206, 0xb70205ff, 0xb65a1a94, 0xb513a3b7, 0x00000000,
    0x3513a3b7, 0x365a1a94, 0x370205ff, 0x37b24206, 0x38378034, 0x388aefb3, 0x38ba1f4b, 0x3923d70b,
    0x398ce705, 0x39c7e283, 0x3a016f01, 0x3a1eecc1, 0x3a3c6a80, 0x3a59e83e, 0x3a7765ff, 0x3aa7ef9d,
    0x3af1a9fc, 0x3b1db22d, 0x3b428f5c, 0x3b676c8a, 0x3b8624dd, 0x3b989374, 0x3bab020d, 0x3bbd70a4,
    0x3bcfdf3b, 0x3be24dd3, 0x3bf4bc6a, 0x3c039581, 0x3c0ccccd, 0x3c160418, 0x3c1f3b64, 0x3c3ae148,
    0x3c68f5c3, 0x3c8b851f, 0x3ca28f5d, 0x3cb9999a, 0x3cd0a3d7, 0x3ce7ae15, 0x3cfeb852, 0x3d0ae148,
    0x3d166667, 0x3d21eb85, 0x3d2d70a3, 0x3d38f5c3, 0x3d447ae1, 0x3d500000, 0x3d5b851f, 0x3d670a3d,
    0x3d728f5d, 0x3d7e147b, 0x3d84cccd, 0x3d8a8f5d, 0x3d9051eb, 0x3d96147b, 0x3d9bd70a, 0x3da1999a,
    0x3da75c2a, 0x3dad1eb8, 0x3db2e148, 0x3db8a3d7, 0x3dbe6667, 0x3dc428f7, 0x3dc9eb85, 0x3ddb3334,
    0x3df80000, 0x3e0a6666, 0x3e18cccd, 0x3e273333, 0x3e35999a, 0x3e440000, 0x3e526666, 0x3e60cccd,
    0x3e6f3333, 0x3e7d9999, 0x3e860000, 0x3e8d3334, 0x3e946666, 0x3e9b999a, 0x3ea2cccc, 0x3eaa0000,
    0x3eb13333, 0x3eb86666, 0x3ebf999a, 0x3ec6cccc, 0x3ece0000, 0x3ed53333, 0x3edc6666, 0x3ee3999a,
    0x3eeacccc, 0x3ef20000, 0x3ef93332, 0x3f003333, 0x3f03cccc, 0x3f076666, 0x3f0b0000, 0x3f0e999a,
    0x3f123334, 0x3f15cccd, 0x3f196666, 0x3f1d0000, 0x3f20999a, 0x3f243334, 0x3f27cccd, 0x3f2b6666,
    0x3f2f0000, 0x3f32999a, 0x3f363334, 0x3f39cccd, 0x3f3d6666, 0x3f410000, 0x3f44999a, 0x3f483333,
    0x3f4bcccd, 0x3f4f6666, 0x3f530000, 0x3f56999a, 0x3f5a3333, 0x3f5dcccd, 0x3f616666, 0x3f650000,
    0x3f68999a, 0x3f6c3333, 0x3f6fcccd, 0x3f736666, 0x3f770000, 0x3f7a999a, 0x3f7e3333, 0x3f800000,
];

/// The dynamic map as values.
pub(crate) fn dynamic_map() -> [f32; 256] {
    DYNAMIC_MAP_BITS.map(f32::from_bits)
}

/// Entries of the 65536-bin lookup table bitsandbytes' CPU kernel
/// quantizes blockwise with.
const LUT_BINS: usize = 65536;

/// bitsandbytes' CPU blockwise quantizer (`quantize_cpu_impl` in
/// `csrc/cpu_ops.cpp`) does not search the code: it splits [-1, 1] into
/// 65536 bins and maps each bin to the first code whose midpoint with the
/// next code is not below the bin's start. This builds that table
/// (`build_quantize_lut`), float for float.
pub(crate) fn blockwise_lut(code: &[f32; 256]) -> Vec<u8> {
    let midpoints: Vec<f32> = code.windows(2).map(|w| 0.5 * (w[0] + w[1])).collect();
    let mut lut = Vec::with_capacity(LUT_BINS);
    let mut index = 0;
    for i in 0..LUT_BINS {
        let start = -1.0 + (2.0 * i as f32) / (LUT_BINS - 1) as f32;
        while index < midpoints.len() && midpoints[index] < start {
            index += 1;
        }
        lut.push(index as u8);
    }
    lut
}

/// The bin of a scaled value (`norm_to_lut_index`). bitsandbytes' build
/// fuses the multiply and add into one FMA, so this does too.
pub(crate) fn lut_bin(value: f32) -> usize {
    let v = value.clamp(-1.0, 1.0);
    ((v + 1.0) * 0.5).mul_add((LUT_BINS - 1) as f32, 0.5) as u16 as usize
}

/// The float dtype names bitsandbytes writes in a quant state (`"dtype"`,
/// `"nested_dtype"`: `str(torch.float16).strip("torch.")`).
pub(crate) fn dtype_name(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F32 => Some("float32"),
        DType::F16 => Some("float16"),
        DType::BF16 => Some("bfloat16"),
        _ => None,
    }
}

/// The dtype a quant state names.
pub(crate) fn dtype_from_name(name: &str) -> Option<DType> {
    [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .find(|d| dtype_name(*d) == Some(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp4_table_and_quantize_order_are_bitsandbytes() {
        let code = FourBitType::Fp4.code();
        assert_eq!(code[2].to_bits(), 0x3f2a_aaab);
        assert_eq!(code[1].to_bits(), 0x3baa_aaab);
        assert_eq!(code[8].to_bits(), 0);
        // torch.argsort(code) as bitsandbytes' default backend computes it.
        let (_, order) = FourBitType::Fp4.quantize_table();
        assert_eq!(
            order,
            [11, 10, 13, 12, 15, 14, 9, 0, 8, 1, 6, 7, 4, 5, 2, 3]
        );
        let (bounds, order) = FourBitType::Nf4.quantize_table();
        assert_eq!(order, std::array::from_fn(|i| i as u8));
        assert!(bounds.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn dynamic_map_is_sorted_and_spans_minus_one_to_one() {
        let map = dynamic_map();
        assert!(map.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!((map[0] < -0.99, map[255]), (true, 1.0));
        let lut = blockwise_lut(&map);
        assert_eq!((lut[0], lut[LUT_BINS - 1]), (0, 255));
        assert_eq!(
            (lut_bin(-1.0), lut_bin(1.0), lut_bin(7.0)),
            (0, 65535, 65535)
        );
    }

    #[test]
    fn names_round_trip_and_bad_ones_are_named() {
        assert_eq!(FourBitType::from_name("nf4").unwrap(), FourBitType::Nf4);
        let err = FourBitType::from_name("int4").unwrap_err();
        assert!(err.to_string().contains("\"int4\""), "{err}");
        assert!(check_four_bit_block_size(64).is_ok());
        let err = check_four_bit_block_size(48).unwrap_err();
        assert!(err.to_string().contains("block size 48"), "{err}");
        for d in [DType::F32, DType::F16, DType::BF16] {
            assert_eq!(dtype_from_name(dtype_name(d).unwrap()), Some(d));
        }
    }
}
