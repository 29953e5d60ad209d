//! Element types, named the way safetensors and torch name them.

use std::fmt;

/// An element type of a tensor. Covers every dtype safetensors and DCP exchange in practice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    Bool,
    U8,
    I8,
    I16,
    I32,
    I64,
    F16,
    BF16,
    F32,
    F64,
    F8E4M3,
    F8E5M2,
}

impl DType {
    /// All dtypes, for tables and property tests.
    pub const ALL: [DType; 12] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
        DType::F8E4M3,
        DType::F8E5M2,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 | DType::F8E4M3 | DType::F8E5M2 => 1,
            DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// The name in a safetensors header (`"BF16"`).
    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::Bool => "BOOL",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::I16 => "I16",
            DType::I32 => "I32",
            DType::I64 => "I64",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::F32 => "F32",
            DType::F64 => "F64",
            DType::F8E4M3 => "F8_E4M3",
            DType::F8E5M2 => "F8_E5M2",
        }
    }

    /// Parses a safetensors header dtype; `None` for dtypes we do not handle.
    pub fn from_safetensors_name(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.safetensors_name() == name)
    }

    /// The attribute of the `torch` module naming this dtype (`torch.bfloat16`).
    pub fn torch_name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F8E4M3 => "float8_e4m3fn",
            DType::F8E5M2 => "float8_e5m2",
        }
    }

    /// Parses a `torch` dtype attribute name.
    pub fn from_torch_name(name: &str) -> Option<DType> {
        let alias = match name {
            "float" => "float32",
            "double" => "float64",
            "half" => "float16",
            "long" => "int64",
            "int" => "int32",
            "short" => "int16",
            other => other,
        };
        DType::ALL.into_iter().find(|d| d.torch_name() == alias)
    }

    /// The typed storage class `torch.save` names for this dtype (`BFloat16Storage`), or `None` for
    /// dtypes that only exist as untyped storage (the float8 family).
    pub fn torch_storage_class(self) -> Option<&'static str> {
        Some(match self {
            DType::Bool => "BoolStorage",
            DType::U8 => "ByteStorage",
            DType::I8 => "CharStorage",
            DType::I16 => "ShortStorage",
            DType::I32 => "IntStorage",
            DType::I64 => "LongStorage",
            DType::F16 => "HalfStorage",
            DType::BF16 => "BFloat16Storage",
            DType::F32 => "FloatStorage",
            DType::F64 => "DoubleStorage",
            DType::F8E4M3 | DType::F8E5M2 => return None,
        })
    }

    /// Parses a typed storage class name back to its dtype.
    pub fn from_torch_storage_class(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.torch_storage_class() == Some(name))
    }

    /// Whether this is a floating-point type (value transforms apply only to these).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64 | DType::F8E4M3 | DType::F8E5M2)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.safetensors_name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_safetensors_name(d.safetensors_name()), Some(d));
            assert_eq!(DType::from_torch_name(d.torch_name()), Some(d));
            if let Some(s) = d.torch_storage_class() {
                assert_eq!(DType::from_torch_storage_class(s), Some(d));
            }
        }
        assert_eq!(DType::from_safetensors_name("C64"), None);
        assert_eq!(DType::BF16.size(), 2);
    }
}
