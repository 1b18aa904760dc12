//! Element types, spelled as safetensors spells them.

use std::fmt;
use std::str::FromStr;

use crate::Error;

/// The element types of the safetensors format.
///
/// The order of the variants follows the safetensors specification; the
/// string forms (`F32`, `BF16`, ...) are the ones stored in headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// Boolean, one byte per element.
    Bool,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// 8-bit float, 4 exponent bits and 3 mantissa bits (`float8_e4m3fn`).
    F8E4M3,
    /// 8-bit float, 5 exponent bits and 2 mantissa bits (`float8_e5m2`).
    F8E5M2,
    /// Signed 16-bit integer.
    I16,
    /// IEEE half precision.
    F16,
    /// Brain float (8 exponent bits, 7 mantissa bits).
    BF16,
    /// Signed 32-bit integer.
    I32,
    /// IEEE single precision.
    F32,
    /// Signed 64-bit integer.
    I64,
    /// IEEE double precision.
    F64,
}

impl DType {
    /// Every dtype, in specification order.
    pub const ALL: [DType; 12] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::F8E4M3,
        DType::F8E5M2,
        DType::I16,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::F32,
        DType::I64,
        DType::F64,
    ];

    /// Bytes one element occupies in memory and in a safetensors file.
    ///
    /// `Bool` is one byte here (as stored); Accelerate's planner counts it as
    /// 1/8 byte, see [`DType::accelerate_byte_size`].
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 | DType::F8E4M3 | DType::F8E5M2 => 1,
            DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// Accelerate's `dtype_byte_size`: as [`DType::size_in_bytes`] except
    /// `bool`, which it counts as 1/8 byte.
    pub fn accelerate_byte_size(self) -> f64 {
        match self {
            DType::Bool => 0.125,
            other => other.size_in_bytes() as f64,
        }
    }

    /// The safetensors header spelling (`"BF16"`).
    pub const fn as_safetensors_str(self) -> &'static str {
        match self {
            DType::Bool => "BOOL",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::F8E4M3 => "F8_E4M3",
            DType::F8E5M2 => "F8_E5M2",
            DType::I16 => "I16",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I32 => "I32",
            DType::F32 => "F32",
            DType::I64 => "I64",
            DType::F64 => "F64",
        }
    }

    /// The dtype of a safetensors header spelling (`"BF16"`), the inverse of
    /// [`DType::as_safetensors_str`]; `None` for any other text.
    pub fn from_safetensors_str(s: &str) -> Option<DType> {
        Some(match s {
            "BOOL" => DType::Bool,
            "U8" => DType::U8,
            "I8" => DType::I8,
            "F8_E4M3" => DType::F8E4M3,
            "F8_E5M2" => DType::F8E5M2,
            "I16" => DType::I16,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            "I32" => DType::I32,
            "F32" => DType::F32,
            "I64" => DType::I64,
            "F64" => DType::F64,
            _ => return None,
        })
    }

    /// The PyTorch/numpy-style name Accelerate's offload index uses
    /// (`"float32"`, `"bfloat16"`, `"float8_e4m3fn"`).
    pub const fn as_torch_str(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::F8E4M3 => "float8_e4m3fn",
            DType::F8E5M2 => "float8_e5m2",
            DType::I16 => "int16",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I32 => "int32",
            DType::F32 => "float32",
            DType::I64 => "int64",
            DType::F64 => "float64",
        }
    }

    /// Parses a PyTorch/numpy-style name, with or without a `torch.` prefix.
    pub fn from_torch_str(name: &str) -> Option<DType> {
        let name = name.strip_prefix("torch.").unwrap_or(name);
        Some(match name {
            "bool" => DType::Bool,
            "uint8" => DType::U8,
            "int8" => DType::I8,
            "float8_e4m3fn" => DType::F8E4M3,
            "float8_e5m2" => DType::F8E5M2,
            "int16" | "short" => DType::I16,
            "float16" | "half" => DType::F16,
            "bfloat16" => DType::BF16,
            "int32" | "int" => DType::I32,
            "float32" | "float" => DType::F32,
            "int64" | "long" => DType::I64,
            "float64" | "double" => DType::F64,
            _ => return None,
        })
    }

    /// True for floating-point types, the only ones a load-time cast touches.
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DType::F8E4M3 | DType::F8E5M2 | DType::F16 | DType::BF16 | DType::F32 | DType::F64
        )
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_safetensors_str())
    }
}

impl FromStr for DType {
    type Err = Error;

    /// Accepts the safetensors spelling (`F16`), the PyTorch one
    /// (`float16`, `torch.float16`) and the short CLI one (`f16`, `bf16`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(d) = DType::from_safetensors_str(s) {
            return Ok(d);
        }
        if let Some(d) = DType::from_torch_str(s) {
            return Ok(d);
        }
        match s.to_ascii_lowercase().as_str() {
            "f64" => Ok(DType::F64),
            "f32" => Ok(DType::F32),
            "f16" => Ok(DType::F16),
            "bf16" => Ok(DType::BF16),
            "i64" => Ok(DType::I64),
            "i32" => Ok(DType::I32),
            "i16" => Ok(DType::I16),
            "i8" => Ok(DType::I8),
            "u8" => Ok(DType::U8),
            "f8_e4m3" => Ok(DType::F8E4M3),
            "f8_e5m2" => Ok(DType::F8E5M2),
            _ => Err(Error::UnknownDType(s.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_safetensors() {
        let sizes: Vec<usize> = DType::ALL.iter().map(|d| d.size_in_bytes()).collect();
        assert_eq!(sizes, [1, 1, 1, 1, 1, 2, 2, 2, 4, 4, 8, 8]);
        assert_eq!(DType::Bool.accelerate_byte_size(), 0.125);
    }

    #[test]
    fn every_spelling_round_trips() {
        for d in DType::ALL {
            assert_eq!(DType::from_safetensors_str(d.as_safetensors_str()), Some(d));
            assert_eq!(d.as_safetensors_str().parse::<DType>().unwrap(), d);
            assert_eq!(d.as_torch_str().parse::<DType>().unwrap(), d);
            assert_eq!(
                format!("torch.{}", d.as_torch_str())
                    .parse::<DType>()
                    .unwrap(),
                d
            );
        }
        // The header spelling only: case and other names are refused there.
        assert_eq!(DType::from_safetensors_str("f32"), None);
        assert_eq!(DType::from_safetensors_str("float32"), None);
        assert_eq!("bf16".parse::<DType>().unwrap(), DType::BF16);
        assert_eq!("f32".parse::<DType>().unwrap(), DType::F32);
    }

    #[test]
    fn unknown_dtype_is_named_in_the_error() {
        let err = "F4".parse::<DType>().unwrap_err();
        assert!(err.to_string().contains("F4"), "{err}");
    }
}
