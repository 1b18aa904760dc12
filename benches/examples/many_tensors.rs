//! Writes the two big-header checkpoints of issue 10 into a folder, for
//! measuring whole commands (`bigmodel inspect`, `bigmodel shard`):
//! `layers-1m.safetensors` (1,000,000 tensors) and `flat-100k.safetensors`
//! (100,000 dotless names).
//!
//! `cargo run --release -p bigmodel-benches --example many_tensors -- DIR`

use bigmodel_benches::many_tensors::{Names, write_many_tensors};

fn main() -> std::io::Result<()> {
    let Some(dir) = std::env::args_os().nth(1) else {
        eprintln!("usage: many_tensors DIR");
        std::process::exit(2);
    };
    let dir = std::path::PathBuf::from(dir);
    std::fs::create_dir_all(&dir)?;
    write_many_tensors(&dir.join("layers-1m.safetensors"), 1_000_000, Names::Layers)?;
    write_many_tensors(&dir.join("flat-100k.safetensors"), 100_000, Names::Flat)?;
    println!("wrote {}", dir.display());
    Ok(())
}
