//! Naming a device.

use std::fmt;
use std::str::FromStr;

/// Where bytes live or work runs: host RAM or one GPU ordinal of the active
/// accelerator backend (CUDA GPU `n`, or emulated device `n` when the
/// [`DeviceSet`](crate::DeviceSet) was created emulated).
///
/// Displays as Accelerate writes device-map values: `cpu`, `0`, `1`, …
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// GPU ordinal `n`.
    Gpu(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Gpu(n) => write!(f, "{n}"),
        }
    }
}

/// The text was not `cpu`, a GPU ordinal or `cuda:N`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseDeviceError(pub String);

impl fmt::Display for ParseDeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} is not a device: expected `cpu`, a GPU ordinal such as `0`, or `cuda:0`",
            self.0
        )
    }
}

impl std::error::Error for ParseDeviceError {}

impl FromStr for Device {
    type Err = ParseDeviceError;

    /// Accepts `cpu`, `0`, `1`, … and PyTorch's `cuda:N` spelling.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("cpu") {
            return Ok(Device::Cpu);
        }
        let digits = t.strip_prefix("cuda:").unwrap_or(t);
        if !digits.is_empty()
            && digits.bytes().all(|b| b.is_ascii_digit())
            && let Ok(n) = digits.parse()
        {
            return Ok(Device::Gpu(n));
        }
        Err(ParseDeviceError(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn displays_like_accelerate_device_map_values() {
        assert_eq!(Device::Cpu.to_string(), "cpu");
        assert_eq!(Device::Gpu(0).to_string(), "0");
        assert_eq!(Device::Gpu(12).to_string(), "12");
    }

    #[test]
    fn parses_cpu_ordinals_and_cuda_prefix() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("3".parse::<Device>().unwrap(), Device::Gpu(3));
        assert_eq!("cuda:1".parse::<Device>().unwrap(), Device::Gpu(1));
        for bad in [
            "",
            "gpu",
            "-1",
            "1.5",
            "cuda:",
            "disk",
            "99999999999999999999999",
        ] {
            let err = bad.parse::<Device>().unwrap_err();
            assert!(err.to_string().contains("is not a device"), "{err}");
        }
    }
}
