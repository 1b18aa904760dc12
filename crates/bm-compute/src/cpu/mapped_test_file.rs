//! Weights for the kernel tests that lie at the very end of a mapped
//! file: the file is a whole number of pages, so a kernel that reads one
//! byte past a weight faults instead of reading a neighbour's bytes.

use bm_tensor::MmapView;

/// `bytes` as the last bytes of a freshly mapped file (removed at once;
/// the mapping keeps its pages).
pub(crate) fn mapped_at_end(bytes: &[u8]) -> MmapView {
    const PAGE: usize = 4096;
    static COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let padded = bytes.len().next_multiple_of(PAGE).max(PAGE);
    let mut file = vec![0u8; padded - bytes.len()];
    file.extend_from_slice(bytes);
    let n = COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("bm-kernel-test-{}-{n}", std::process::id()));
    std::fs::write(&path, &file).expect("writing the test file");
    let view = MmapView::open(&path).expect("mapping the test file");
    std::fs::remove_file(&path).expect("removing the test file");
    view.slice(padded - bytes.len()..padded)
        .expect("the weight's window")
}
