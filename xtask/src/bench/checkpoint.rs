//! The checkpoint-reading rows: reads against memcpy of the same bytes,
//! and opening a sparse 64 GiB file against Python's `safe_open`.

use super::Suite;
use super::criterion::lookup;
use super::report::{Cell, Row, Unit};

impl Suite {
    pub(super) fn checkpoint_rows(&self) -> Vec<Row> {
        const S: &str = "Checkpoint reading (CPU)";
        eprintln!("== bench: checkpoint read");
        let mib: u64 = if self.quick { 256 } else { 1024 };
        let ours = self.criterion(
            "checkpoint_read",
            &[],
            &[("BM_BENCH_CKPT_MIB", mib.to_string())],
        );
        // The bench reads 64 equal F32 tensors of mib MiB in all.
        let bytes = 64 * ((mib << 20) / 64 / 4 * 4);
        let gbps = |id: String| -> Result<f64, String> {
            let ns = lookup(ours.as_ref().map_err(Clone::clone)?, &id)?;
            Ok(bytes as f64 / ns)
        };
        let mut rows = vec![
            Row::new(
                S,
                format!("read a {mib} MiB checkpoint into fresh host buffers"),
                Unit::GigabytesPerSecond,
            )
            .bigmodel(Cell::from(gbps(format!(
                "read_to_host/checkpoint_read_as_{mib}MiB"
            ))))
            .baseline(
                "memcpy of the same bytes into fresh buffers",
                Cell::from(gbps(format!("read_to_host/memcpy_{mib}MiB"))),
            )
            .note("warm page cache; ratio = share of memcpy speed"),
            Row::new(
                S,
                format!("read a {mib} MiB checkpoint into reused buffers"),
                Unit::GigabytesPerSecond,
            )
            .bigmodel(Cell::from(gbps(format!(
                "read_to_host/checkpoint_read_into_reused_{mib}MiB"
            ))))
            .baseline(
                "memcpy into reused buffers",
                Cell::from(gbps(format!("read_to_host/memcpy_reused_{mib}MiB"))),
            )
            .note("the copy alone, no page faults of new allocations"),
        ];
        let open = ours
            .as_ref()
            .map_err(Clone::clone)
            .and_then(|m| lookup(m, "inspect/open_sparse_64GiB_2048_tensors"))
            .map(|ns| ns * 1e-9);
        let python = self.sparse.clone().and_then(|path| {
            let v = self.baseline(&["inspect", &path.to_string_lossy(), "--repeats", "20"])?;
            v["seconds"]
                .as_f64()
                .ok_or_else(|| "not available: no seconds in the baseline's answer".to_string())
        });
        rows.push(
            Row::new(
                S,
                "open a sparse 64 GiB checkpoint (2048 tensors), in-process",
                Unit::Seconds,
            )
            .bigmodel(Cell::from(open))
            .baseline(
                "safetensors safe_open listing every name, dtype, shape",
                Cell::from(python),
            )
            .note("headers only: the file is sparse; median"),
        );
        rows
    }
}
