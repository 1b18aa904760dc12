//! Safetensors files of many one-byte tensors: headers of up to ~85 MB,
//! the shape that made reading and summarising quadratic before (issue 10).

use std::io::{BufWriter, Write};
use std::path::Path;

/// How the tensors of [`write_many_tensors`] are named.
#[derive(Clone, Copy, Debug)]
pub enum Names {
    /// `model.layers.{i}.weight`: a module and a layer per tensor.
    Layers,
    /// `t{i}`: no dots, so every tensor is its own top-level module.
    Flat,
}

/// Writes a safetensors file of `count` one-byte U8 tensors: a header of
/// about 70 bytes per tensor, the shape that made reading and summarising
/// quadratic before (issue 10: 1,000,000 tensors make a ~85 MB header).
pub fn write_many_tensors(path: &Path, count: usize, names: Names) -> std::io::Result<()> {
    let mut json = Vec::with_capacity(80 * count + 2);
    json.push(b'{');
    for i in 0..count {
        if i > 0 {
            json.push(b',');
        }
        match names {
            Names::Layers => write!(json, "\"model.layers.{i}.weight\"")?,
            Names::Flat => write!(json, "\"t{i}\"")?,
        }
        write!(
            json,
            ":{{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[{i},{}]}}",
            i + 1
        )?;
    }
    json.push(b'}');
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut out = BufWriter::new(std::fs::File::create(path)?);
    out.write_all(&(json.len() as u64).to_le_bytes())?;
    out.write_all(&json)?;
    out.write_all(&vec![1u8; count])?;
    out.flush()
}
