//! `bigmodel inspect`: what a checkpoint holds, from its headers alone.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::PathBuf;

use bigmodel::plan::human_bytes;
use bigmodel::shard::Checkpoint;
use serde_json::{Map, Value, json};

use super::CmdResult;

/// Arguments of `bigmodel inspect`.
#[derive(clap::Args)]
pub struct Args {
    /// A .safetensors or PyTorch .bin file, a *.index.json, or a folder holding
    /// model.safetensors, exactly one *.index.json, or pytorch_model.bin.
    pub checkpoint: PathBuf,
    /// Write one JSON document to stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Runs the command.
pub fn run(args: Args) -> CmdResult {
    let ckpt = Checkpoint::open(&args.checkpoint)?;
    let summary = Summary::of(&ckpt);
    if args.json {
        print_stdout(&(serde_json::to_string_pretty(&summary.to_json(&ckpt))? + "\n"))
    } else {
        print_stdout(&summary.to_table(&ckpt))
    }
}

/// Byte counts of a checkpoint, in first-seen order.
struct Summary<'a> {
    tensors: usize,
    total_bytes: u64,
    dtypes: Vec<(&'a str, u64)>,
    modules: Vec<(&'a str, u64)>,
    largest_layer: Option<(&'a str, u64)>,
    /// Names of one tensor (a PyTorch file's tied weights), counted once.
    tied: Vec<Vec<&'a str>>,
}

impl<'a> Summary<'a> {
    fn of(ckpt: &'a Checkpoint) -> Summary<'a> {
        let mut dtypes = Totals::default();
        let mut modules = Totals::default();
        let mut layers = Totals::default();
        let mut total_bytes = 0;
        let ties = ckpt.ties();
        let repeated: std::collections::HashSet<&str> =
            ties.iter().flat_map(|g| g[1..].iter().copied()).collect();
        for (name, meta) in ckpt.tensors() {
            if repeated.contains(name) {
                continue;
            }
            let bytes = meta.byte_len() as u64;
            total_bytes += bytes;
            dtypes.add(meta.dtype.as_safetensors_str(), bytes);
            modules.add(name.split('.').next().unwrap_or(name), bytes);
            layers.add(layer_of(name), bytes);
        }
        // The first of equals wins, as in Accelerate's get_max_layer_size.
        let largest_layer = layers
            .rows
            .into_iter()
            .fold(None, |best: Option<(&str, u64)>, l| match &best {
                Some(b) if b.1 >= l.1 => best,
                _ => Some(l),
            });
        Summary {
            tensors: ckpt.len(),
            total_bytes,
            dtypes: dtypes.rows,
            modules: modules.rows,
            largest_layer,
            tied: ties,
        }
    }

    fn to_json(&self, ckpt: &Checkpoint) -> Value {
        let map = |v: &[(&str, u64)]| -> Map<String, Value> {
            v.iter().map(|(k, b)| (k.to_string(), json!(b))).collect()
        };
        let files: Vec<Value> = ckpt
            .files()
            .iter()
            .map(|f| json!({"path": f.path, "tensors": f.tensors, "bytes": f.data_bytes}))
            .collect();
        json!({
            "checkpoint": ckpt.path(),
            "index": ckpt.index_path(),
            "tensors": self.tensors,
            "total_bytes": self.total_bytes,
            "dtypes": map(&self.dtypes),
            "modules": map(&self.modules),
            "largest_layer": self.largest_layer.as_ref().map(|(n, b)| json!({"name": n, "bytes": b})),
            "tied": self.tied,
            "files": files,
        })
    }

    fn to_table(&self, ckpt: &Checkpoint) -> String {
        let mut out = format!("checkpoint   {}\n", ckpt.path().display());
        if let Some(index) = ckpt.index_path() {
            out += &format!("index        {}\n", index.display());
        }
        out += &format!(
            "files        {}\ntensors      {}\ntotal        {}\n",
            ckpt.files().len(),
            self.tensors,
            human_bytes(self.total_bytes)
        );
        if let Some((name, bytes)) = &self.largest_layer {
            out += &format!("largest      {} ({})\n", shown(name), human_bytes(*bytes));
        }
        for group in &self.tied {
            let names: Vec<Cow<'_, str>> = group.iter().map(|n| shown(n)).collect();
            out += &format!("tied         {} (counted once)\n", names.join(" = "));
        }
        for (title, rows) in [("dtype", &self.dtypes), ("module", &self.modules)] {
            let shown: Vec<Cow<'_, str>> = rows.iter().map(|r| shown(r.0)).collect();
            let width = shown
                .iter()
                .map(|k| k.chars().count())
                .max()
                .unwrap_or(0)
                .max(title.len());
            out += &format!("\n{title:<width$}  bytes\n");
            for (k, (_, b)) in shown.iter().zip(rows.iter()) {
                out += &format!("{k:<width$}  {} ({})\n", b, human_bytes(*b));
            }
        }
        out
    }
}

/// Byte totals per key in first-seen order; O(1) per addition and keys
/// borrowed from the checkpoint, so a million distinct names are summed in
/// linear time without copies.
#[derive(Default)]
struct Totals<'a> {
    rows: Vec<(&'a str, u64)>,
    position: HashMap<&'a str, usize>,
}

impl<'a> Totals<'a> {
    fn add(&mut self, key: &'a str, bytes: u64) {
        match self.position.get(key) {
            Some(&i) => self.rows[i].1 += bytes,
            None => {
                self.position.insert(key, self.rows.len());
                self.rows.push((key, bytes));
            }
        }
    }
}

/// Names longer than this are cut in the table (a hostile file may hold
/// names of any length; padding to one would also fail past 65535).
const SHOWN_NAME_CHARS: usize = 96;

/// `name` as the table shows it: whole, or its first characters and how
/// long it is (`--json` keeps every name whole).
fn shown(name: &str) -> Cow<'_, str> {
    match name.char_indices().nth(SHOWN_NAME_CHARS) {
        None => Cow::Borrowed(name),
        Some((cut, _)) => Cow::Owned(format!(
            "{}... ({} bytes; whole with --json)",
            &name[..cut],
            name.len()
        )),
    }
}

/// The layer a tensor belongs to: its name up to the first numeric
/// component (`model.layers.3`), else its parent module.
fn layer_of(name: &str) -> &str {
    let mut end = 0;
    for part in name.split('.') {
        end += part.len();
        if !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) {
            return &name[..end];
        }
        end += 1;
    }
    name.rsplit_once('.').map_or(name, |(parent, _)| parent)
}

/// Writes `text` to stdout; a reader that went away (`| head`) is not an
/// error worth a message, any other failure is.
pub(crate) fn print_stdout(text: &str) -> CmdResult {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(format!("writing to stdout: {e}").into())
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_are_numbered_blocks_or_parent_modules() {
        assert_eq!(
            layer_of("model.layers.3.mlp.up_proj.weight"),
            "model.layers.3"
        );
        assert_eq!(layer_of("h.10.attn.bias"), "h.10");
        assert_eq!(layer_of("model.embed_tokens.weight"), "model.embed_tokens");
        assert_eq!(layer_of("bias"), "bias");
    }

    #[test]
    fn long_names_are_cut_for_the_table_on_a_char_boundary() {
        assert_eq!(shown("model.embed"), "model.embed");
        let exact = "é".repeat(SHOWN_NAME_CHARS);
        assert_eq!(shown(&exact), exact.as_str());
        let long = format!("{exact}x");
        assert_eq!(
            shown(&long),
            format!("{exact}... ({} bytes; whole with --json)", long.len())
        );
    }
}
