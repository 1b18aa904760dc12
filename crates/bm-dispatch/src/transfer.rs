//! How a tensor's bytes reach another device, each byte copied once per
//! hop: page-locked host memory straight to a GPU by DMA on its copy
//! stream; mapped files, files and other host memory through bm-device's
//! reader pool, whose threads fill page-locked staging slots (from the
//! mapping, or from the file with `O_DIRECT`) while the copy stream drains
//! the slots already filled; GPU memory peer to peer, or downloaded.
//! Copies are only enqueued: the bytes arrive with the event of their copy
//! ([`Arrival`]), and whoever computes with them waits on it, on the
//! compute stream, when it takes them.
//!
//! Loading a checkpoint onto a GPU ([`GpuLoad`]) uploads the stored bytes
//! the same way and, when the dtype changes, casts them on the GPU after
//! the upload (`Gpu::cast_exact`, bit for bit the host's cast). The host
//! casts instead for emulated GPUs and for a CUDA GPU that cannot run its
//! kernels.

use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bm_device::{
    Device, DeviceBuffer, DeviceSet, Event, Gpu, GpuKind, ReadSource, ReaderOptions, ReaderPool,
    SourceFile,
};
use bm_tensor::{DType, HostBuffer, cast_into};
use parking_lot::Mutex;

use crate::bytes::Bytes;
use crate::{Error, Result};

/// Bytes on their way to a device: where they will be, and the copy that
/// must complete before anything reads them there (`None` when they are
/// usable at once). Whoever takes them for compute makes that device's
/// compute stream wait on `ready` ([`Arrival::wait_for_compute`]); nothing
/// else waits, so a copy enqueued by the prefetch thread never stalls the
/// kernels of the block running meanwhile.
#[derive(Clone, Debug)]
pub(crate) struct Arrival {
    /// The bytes at their destination.
    pub(crate) bytes: Arc<Bytes>,
    /// Completes when the copy that fills `bytes` has landed.
    pub(crate) ready: Option<Event>,
}

impl Arrival {
    /// Bytes usable where they are.
    pub(crate) fn ready(bytes: Arc<Bytes>) -> Arrival {
        Arrival { bytes, ready: None }
    }

    /// Orders the compute stream of the bytes' GPU after their copy: the
    /// kernels enqueued from now on see them. Host bytes need nothing.
    pub(crate) fn wait_for_compute(&self, what: &str) -> Result<()> {
        let (Some(event), Bytes::Device(buf)) = (&self.ready, self.bytes.as_ref()) else {
            return Ok(());
        };
        buf.gpu()
            .compute_stream()
            .wait(event)
            .map_err(|e| Error::device(what, e))
    }
}

/// How disk-offloaded weights are read on their way to a GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DiskReads {
    /// Direct reads when the disk-offloaded weights are more than the host
    /// memory available (the page cache could not keep them anyway, and
    /// each pass would evict what the next needs), else through the page
    /// cache.
    #[default]
    Auto,
    /// Always `O_DIRECT` where the file system allows it: each pass reads
    /// the disk at its sequential speed and leaves the page cache alone.
    Direct,
    /// Always through the page cache (the file's mapping).
    Cached,
}

/// Host bytes shared with the reader threads.
struct HostSource(Arc<Bytes>);

impl AsRef<[u8]> for HostSource {
    fn as_ref(&self) -> &[u8] {
        // Only built over host and mapped bytes, whose `host` never waits.
        self.0.host().unwrap_or(&[])
    }
}

/// What uploads to GPUs go through: bm-device's reader pool (made on first
/// use: threads and page-locked slots cost nothing to a model that never
/// uploads), the files disk-offloaded weights are read from with
/// `O_DIRECT`, and whether they are.
pub(crate) struct Uploader {
    devices: Arc<DeviceSet>,
    readers: Mutex<Option<Arc<ReaderPool>>>,
    files: Mutex<HashMap<PathBuf, Arc<SourceFile>>>,
    direct: AtomicBool,
}

impl std::fmt::Debug for Uploader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Uploader")
            .field(
                "readers",
                &self.readers.lock().as_deref().map(|_| "started"),
            )
            .field("direct", &self.direct.load(Ordering::Relaxed))
            .finish()
    }
}

impl Uploader {
    pub(crate) fn new(devices: Arc<DeviceSet>) -> Uploader {
        Uploader {
            devices,
            readers: Mutex::new(None),
            files: Mutex::new(HashMap::new()),
            direct: AtomicBool::new(false),
        }
    }

    /// The devices uploads go to.
    pub(crate) fn devices(&self) -> &DeviceSet {
        &self.devices
    }

    /// Reads mapped files directly (`O_DIRECT`) from now on, or through
    /// the mapping.
    pub(crate) fn set_direct(&self, direct: bool) {
        self.direct.store(direct, Ordering::Relaxed);
    }

    fn readers(&self) -> Result<Arc<ReaderPool>> {
        let mut readers = self.readers.lock();
        if let Some(pool) = readers.as_ref() {
            return Ok(Arc::clone(pool));
        }
        let pool = Arc::new(
            self.devices
                .reader_pool(reader_options())
                .map_err(|e| Error::device("the reader pool", e))?,
        );
        *readers = Some(Arc::clone(&pool));
        Ok(pool)
    }

    /// Where the reader threads take `bytes` (host or mapped) from: the
    /// mapped file itself when reads are direct, else the memory.
    fn source(&self, what: &str, bytes: &Arc<Bytes>) -> Result<(ReadSource, Range<u64>)> {
        let len = bytes.len() as u64;
        if let (Bytes::Mmap(view), true) = (bytes.as_ref(), self.direct.load(Ordering::Relaxed))
            && let Some(file) = self.file(what, view)?
        {
            let start = view.file_offset() as u64;
            return Ok((ReadSource::File(file), start..start + len));
        }
        Ok((
            ReadSource::Bytes(Arc::new(HostSource(Arc::clone(bytes)))),
            0..len,
        ))
    }

    /// The file behind `view`, opened once for direct reads; `None` when
    /// the path no longer leads to the file mapped (a regular file with the
    /// same device and inode; anything else is not opened): another process
    /// renamed its own file over it (a run sharing the offload folder), so
    /// the bytes are read through the mapping, which holds this process's.
    fn file(&self, what: &str, view: &bm_tensor::MmapView) -> Result<Option<Arc<SourceFile>>> {
        let path = view.path();
        if let Some(f) = self.files.lock().get(path) {
            return Ok(Some(Arc::clone(f)).filter(|f| f.every_descriptor(|m| view.is_backed_by(m))));
        }
        let Ok(meta) = std::fs::metadata(path) else {
            return Ok(None);
        };
        if !meta.is_file() || !view.is_backed_by(&meta) {
            return Ok(None);
        }
        let file = SourceFile::open(path, true).map_err(|e| Error::device(what, e))?;
        if !file.every_descriptor(|m| view.is_backed_by(m)) {
            return Ok(None);
        }
        self.files
            .lock()
            .insert(path.to_path_buf(), Arc::clone(&file));
        Ok(Some(file))
    }

    /// Copies host or mapped `src` into `dst` at `offset` on the copy
    /// stream of `dst`'s GPU through the reader pool; returns once `src`
    /// was read, with the event of the last copy.
    fn upload(
        &self,
        what: &str,
        src: &Arc<Bytes>,
        dst: &mut DeviceBuffer,
        offset: usize,
    ) -> Result<Event> {
        let (source, range) = self.source(what, src)?;
        let copy = dst.gpu().copy_stream().clone();
        self.readers()?
            .upload(&source, range, dst, offset, &copy)
            .map_err(|e| Error::device(what, e))
    }
}

/// GPU `device` of `devices`.
fn gpu_of(what: &str, device: Device, devices: &DeviceSet) -> Result<Gpu> {
    let missing = || Error::NoSuchDevice {
        what: what.to_string(),
        device,
    };
    match device {
        Device::Gpu(i) => devices.gpu(i).cloned().map_err(|_| missing()),
        Device::Cpu => Err(missing()),
    }
}

/// `len` bytes (at least one) of `gpu`'s memory for `what`, allocated on
/// the copy stream that fills it (so the copy waits for no compute).
fn alloc_for_copy(what: &str, gpu: &Gpu, len: usize) -> Result<DeviceBuffer> {
    gpu.alloc_on(len.max(1), gpu.copy_stream())
        .map_err(|e| Error::device(what, e))
}

/// Copies host `src` into freshly allocated page-locked memory (pageable
/// when the set cannot pin).
pub(crate) fn pin(what: &str, src: &[u8], devices: &DeviceSet) -> Result<Bytes> {
    let mut p = devices
        .alloc_pinned(src.len().max(1))
        .map_err(|e| Error::device(what, e))?;
    p.as_mut_slice()
        .map_err(|e| Error::device(what, e))?
        .get_mut(..src.len())
        .ok_or_else(|| Error::BadOption(format!("{what}: pinned buffer too small")))?
        .copy_from_slice(src);
    Ok(Bytes::Pinned(p))
}

/// The one path of a tensor's bytes to another device, each byte copied
/// once per hop: page-locked memory straight to the GPU by DMA on its copy
/// stream (no staging copy); mapped and other host memory through the
/// reader pool of `uploader` (a plain pageable copy without one); GPU
/// memory to another GPU on the destination's copy stream, or downloaded
/// to the host. Bytes already on `device` are shared, not copied. The copy
/// may still be in flight on return: see [`Arrival`].
pub(crate) fn to_device(
    what: &str,
    bytes: &Arc<Bytes>,
    device: Device,
    devices: &DeviceSet,
    uploader: Option<&Uploader>,
) -> Result<Arrival> {
    if bytes.device() == device {
        return Ok(Arrival::ready(Arc::clone(bytes)));
    }
    if device == Device::Cpu {
        let host = bytes.to_host()?;
        let buf = HostBuffer::from_bytes(&host).map_err(|e| Error::tensor(what, e))?;
        return Ok(Arrival::ready(Arc::new(Bytes::Host(buf))));
    }
    let gpu = gpu_of(what, device, devices)?;
    let mut dst = alloc_for_copy(what, &gpu, bytes.len())?;
    let copy = gpu.copy_stream();
    let device_error = |e| Error::device(what, e);
    let ready = match (bytes.as_ref(), uploader) {
        (Bytes::Pinned(src), _) => dst
            .copy_from_pinned(0, src, 0..src.len(), copy)
            .map_err(device_error)?,
        (Bytes::Device(src), _) => dst
            .copy_from_device(0, src, 0..src.len(), copy)
            .map_err(device_error)?,
        (_, Some(uploader)) => uploader.upload(what, bytes, &mut dst, 0)?,
        (host, None) => {
            dst.copy_from_host(0, host.host().unwrap_or(&[]))
                .map_err(device_error)?;
            Event::completed(device)
        }
    };
    Ok(Arrival {
        bytes: Arc::new(Bytes::Device(dst)),
        ready: Some(ready),
    })
}

/// Moves `bytes` to `device` for use by the calling thread (a copy; shared
/// when already there): [`to_device`], with the destination's compute
/// stream ordered after the copy.
pub(crate) fn move_bytes(
    what: &str,
    bytes: &Arc<Bytes>,
    device: Device,
    devices: &DeviceSet,
    uploader: Option<&Uploader>,
) -> Result<Arc<Bytes>> {
    let arrival = to_device(what, bytes, device, devices, uploader)?;
    arrival.wait_for_compute(what)?;
    Ok(arrival.bytes)
}

/// Source elements converted per chunk by a GPU cast: two device scratch
/// buffers of this many bytes let the upload of one chunk overlap the cast
/// of the previous one, with bounded extra device memory.
pub const GPU_CAST_CHUNK: usize = 16 << 20;

/// How one GPU converts dtypes during a load.
enum CastOn {
    /// Not needed yet.
    Undecided,
    /// On the GPU.
    Gpu(Box<GpuCaster>),
    /// On the host, before the upload: an emulated GPU, no room for the
    /// scratch buffers, or kernels the GPU cannot run.
    Host,
}

/// Casts on one GPU: raw source bytes uploaded chunk by chunk into two
/// scratch buffers used in turn, each chunk cast into the destination on
/// the compute stream once its upload landed.
struct GpuCaster {
    gpu: Gpu,
    scratch: [DeviceBuffer; 2],
    next: usize,
    /// A cast ran: the GPU can run its kernels.
    proven: bool,
}

impl GpuCaster {
    /// The scratch buffers of `gpu`, or `None` when it is emulated (it has
    /// no kernels) or has no room for them.
    fn new(gpu: &Gpu) -> Option<GpuCaster> {
        if gpu.kind() != GpuKind::Cuda {
            return None;
        }
        let scratch = || alloc_for_copy("GPU cast scratch", gpu, GPU_CAST_CHUNK).ok();
        Some(GpuCaster {
            gpu: gpu.clone(),
            scratch: [scratch()?, scratch()?],
            next: 0,
            proven: false,
        })
    }

    /// `src` (`from` elements, host or mapped) into `dst` as `to` elements.
    fn cast(
        &mut self,
        name: &str,
        src: &Arc<Bytes>,
        from: DType,
        dst: &mut DeviceBuffer,
        to: DType,
        uploader: &Uploader,
    ) -> Result<()> {
        let from_size = from.size_in_bytes();
        let count = src.len() / from_size;
        let per_chunk = GPU_CAST_CHUNK / from_size;
        let (source, range) = uploader.source(name, src)?;
        let readers = uploader.readers()?;
        for start in (0..count).step_by(per_chunk) {
            let n = per_chunk.min(count - start);
            let buf = &mut self.scratch[self.next];
            self.next = 1 - self.next;
            let first = range.start + (start * from_size) as u64;
            let uploaded = readers
                .upload(
                    &source,
                    first..first + (n * from_size) as u64,
                    buf,
                    0,
                    self.gpu.copy_stream(),
                )
                .map_err(|e| Error::device(name, e))?;
            self.gpu
                .compute_stream()
                .wait(&uploaded)
                .map_err(|e| Error::device(name, e))?;
            self.gpu
                .cast_exact(buf, from, dst, to, n, start)
                .map_err(|e| Error::device(name, e))?;
        }
        self.proven = true;
        Ok(())
    }
}

/// Loading tensors onto GPUs: stored bytes uploaded through the reader
/// pool on each GPU's copy stream, converted on the GPU when the dtype
/// changes, and everything waited for once, at [`GpuLoad::finish`].
pub(crate) struct GpuLoad<'a> {
    uploader: &'a Uploader,
    /// Per GPU ordinal: how it casts, and whether anything was enqueued.
    gpus: Vec<(CastOn, bool)>,
}

impl<'a> GpuLoad<'a> {
    pub(crate) fn new(uploader: &'a Uploader) -> GpuLoad<'a> {
        GpuLoad {
            gpus: (0..uploader.devices.gpu_count())
                .map(|_| (CastOn::Undecided, false))
                .collect(),
            uploader,
        }
    }

    /// Tensor `name`, stored as `src` (host or mapped bytes) in `from`,
    /// onto GPU `device` in `to`. The copies (and the cast) may still be
    /// running on return.
    pub(crate) fn write(
        &mut self,
        name: &str,
        src: &Arc<Bytes>,
        from: DType,
        to: DType,
        device: Device,
    ) -> Result<Bytes> {
        let gpu = gpu_of(name, device, &self.uploader.devices)?;
        let count = src.len() / from.size_in_bytes().max(1);
        let len = count * to.size_in_bytes();
        let (cast_on, used) = &mut self.gpus[gpu.ordinal()];
        *used = true;
        if from == to {
            let mut dst = alloc_for_copy(name, &gpu, len)?;
            if !src.is_empty() {
                self.uploader.upload(name, src, &mut dst, 0)?;
            }
            return Ok(Bytes::Device(dst));
        }
        // Written by the cast kernels, on the compute stream.
        let mut dst = gpu.alloc(len.max(1)).map_err(|e| Error::device(name, e))?;
        let kernels = [DType::F32, DType::F16, DType::BF16];
        if kernels.contains(&from) && kernels.contains(&to) {
            if matches!(cast_on, CastOn::Undecided) {
                *cast_on = GpuCaster::new(&gpu).map_or(CastOn::Host, |c| CastOn::Gpu(Box::new(c)));
            }
            if let CastOn::Gpu(caster) = cast_on {
                match caster.cast(name, src, from, &mut dst, to, self.uploader) {
                    Ok(()) => return Ok(Bytes::Device(dst)),
                    // The first cast shows whether this GPU can run its
                    // kernels at all (NVRTC may be missing): if not, the
                    // host casts this tensor and every later one.
                    Err(_) if !caster.proven => *cast_on = CastOn::Host,
                    Err(e) => return Err(e),
                }
            }
        }
        cast_chunks(
            name,
            src.host().unwrap_or(&[]),
            from,
            to,
            &mut |offset, piece| {
                dst.copy_from_host(offset, piece)
                    .map_err(|e| Error::device(name, e))
            },
        )?;
        Ok(Bytes::Device(dst))
    }

    /// Waits until every copy and cast enqueued by [`GpuLoad::write`] has
    /// completed, and frees the cast scratch buffers.
    pub(crate) fn finish(self) -> Result<()> {
        for (ordinal, (_, used)) in self.gpus.iter().enumerate() {
            if !used {
                continue;
            }
            let gpu = gpu_of(
                "the loaded tensors",
                Device::Gpu(ordinal),
                &self.uploader.devices,
            )?;
            for stream in [gpu.copy_stream(), gpu.compute_stream()] {
                stream
                    .synchronize()
                    .map_err(|e| Error::device("the loaded tensors", e))?;
            }
        }
        Ok(())
    }
}

/// Bytes cast at a time on the host: the bound on host staging memory of a
/// cast while loading.
pub const STAGING_BYTES: usize = 8 << 20;

/// The reader pool a model creates at its first upload to a GPU (loading
/// or streaming) and keeps for its life.
fn reader_options() -> ReaderOptions {
    ReaderOptions::default()
}

/// Host memory a model that loads onto or streams to a GPU holds for
/// staging: its reader pool's slots (page-locked, for its life) and the
/// [`STAGING_BYTES`] a host cast converts at a time. The memory ledger's
/// `staging` item.
pub fn host_staging_bytes() -> u64 {
    reader_options()
        .staging_bytes()
        .saturating_add(STAGING_BYTES as u64)
}

/// Runs `sink(offset, bytes)` over `src` converted from `from` to `to`,
/// [`STAGING_BYTES`] at a time (borrowing `src` when no cast is needed).
pub(crate) fn cast_chunks(
    name: &str,
    src: &[u8],
    from: DType,
    to: DType,
    sink: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
) -> Result<()> {
    let (src_elem, dst_elem) = (from.size_in_bytes(), to.size_in_bytes());
    let elems = (STAGING_BYTES / src_elem.max(dst_elem)).max(1);
    let mut staging = Vec::new();
    let mut offset = 0;
    for chunk in src.chunks(elems * src_elem) {
        if from == to {
            sink(offset, chunk)?;
            offset += chunk.len();
            continue;
        }
        let n = chunk.len() / src_elem * dst_elem;
        staging.resize(n, 0u8);
        cast_into(chunk, from, &mut staging, to).map_err(|e| Error::tensor(name, e))?;
        sink(offset, &staging)?;
        offset += n;
    }
    Ok(())
}
