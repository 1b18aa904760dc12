//! Safetensors files of F32 tensors stored back to back in order: the
//! header every bench input shares, models of fixed pseudo-random values for
//! the decode benches, and sparse files (a header and a hole,
//! for measuring what opening a huge checkpoint costs without the disk).

use std::fs;
use std::io::{self, Write};
use std::path::Path;

/// A tensor by name and shape.
pub type Tensor = (String, Vec<usize>);

/// `count` tensors `model.layers.{i}.weight` of `bytes_each` bytes (rounded
/// down to whole F32 elements) each.
pub fn layers(count: usize, bytes_each: u64) -> Vec<Tensor> {
    (0..count)
        .map(|i| {
            (
                format!("model.layers.{i}.weight"),
                vec![(bytes_each / 4) as usize],
            )
        })
        .collect()
}

/// Writes a safetensors file at `path` holding `tensors` with small
/// pseudo-random values (a fixed xorshift sequence, so every run reads the
/// same model), norm weights (`*norm.weight`) at 1.0, as the model benches
/// need a model whose activations stay finite.
pub fn write_random(path: &Path, tensors: &[Tensor]) -> io::Result<()> {
    let mut out = io::BufWriter::new(fs::File::create(path)?);
    out.write_all(&header(tensors, &[]))?;
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for (name, shape) in tensors {
        let numel: usize = shape.iter().product();
        let norm = name.ends_with("norm.weight");
        let mut values = Vec::with_capacity(4 * numel);
        for _ in 0..numel {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let v = if norm {
                1.0f32
            } else {
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
            };
            values.extend_from_slice(&v.to_le_bytes());
        }
        out.write_all(&values)?;
    }
    out.flush()
}

/// Bytes of the tensors' data.
pub fn data_len(tensors: &[Tensor]) -> u64 {
    tensors
        .iter()
        .map(|(_, shape)| 4 * shape.iter().product::<usize>() as u64)
        .sum()
}

/// Everything before the data: the header's length (8 bytes, little
/// endian) and the header, `__metadata__` first when `metadata` has
/// entries, padded with spaces to a multiple of 8.
pub fn header(tensors: &[Tensor], metadata: &[(&str, &str)]) -> Vec<u8> {
    let mut json = String::from("{");
    if !metadata.is_empty() {
        let entries: Vec<String> = metadata
            .iter()
            .map(|(k, v)| format!("{}:{}", quoted(k), quoted(v)))
            .collect();
        json.push_str(&format!("\"__metadata__\":{{{}}}", entries.join(",")));
    }
    let mut offset = 0u64;
    for (name, shape) in tensors {
        let len = 4 * shape.iter().product::<usize>() as u64;
        let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
        if json.len() > 1 {
            json.push(',');
        }
        json.push_str(&format!(
            "{}:{{\"dtype\":\"F32\",\"shape\":[{}],\"data_offsets\":[{offset},{}]}}",
            quoted(name),
            dims.join(","),
            offset + len
        ));
        offset += len;
    }
    json.push('}');
    while !json.len().is_multiple_of(8) {
        json.push(' ');
    }
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(json.as_bytes());
    bytes
}

fn quoted(text: &str) -> String {
    serde_json::Value::from(text).to_string()
}

/// Writes a file of `tensors` whose data is a hole: only the header takes
/// disk. Written to `PATH.partial`, synced and renamed into place.
pub fn write_sparse(path: &Path, tensors: &[Tensor]) -> io::Result<()> {
    let header = header(tensors, &[]);
    let partial = path.with_extension("partial");
    let mut file = fs::File::create(&partial)?;
    file.write_all(&header)?;
    file.set_len(header.len() as u64 + data_len(tensors))?;
    file.sync_all()?;
    fs::rename(&partial, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_tile_the_data_and_keep_metadata_first() {
        let tensors = vec![("a".to_string(), vec![2, 3]), ("b\"".to_string(), vec![])];
        let bytes = header(&tensors, &[("format", "pt")]);
        let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!(bytes.len(), 8 + len);
        assert_eq!(len % 8, 0);
        let json = std::str::from_utf8(&bytes[8..]).unwrap();
        assert!(json.starts_with(r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}"#), "{json}");
        let parsed: serde_json::Value = serde_json::from_str(json.trim_end()).unwrap();
        assert_eq!(parsed["b\""]["data_offsets"], serde_json::json!([24, 28]));
        assert_eq!(data_len(&tensors), 28);
        assert!(header(&[], &[]).ends_with(b"{}      "));
    }

    #[test]
    fn sparse_files_have_their_full_length() {
        let dir = std::env::temp_dir().join(format!("bm-benches-sparse-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("sparse.safetensors");
        let tensors = layers(3, 1 << 20);
        write_sparse(&path, &tensors).unwrap();
        let header = header(&tensors, &[]);
        assert_eq!(
            fs::metadata(&path).unwrap().len(),
            header.len() as u64 + (3 << 20)
        );
        assert_eq!(fs::read(&path).unwrap()[..header.len()], header[..]);
        assert!(!path.with_extension("partial").exists());
        fs::remove_dir_all(&dir).unwrap();
    }
}
