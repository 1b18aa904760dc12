//! How a tensor's bytes reach another device, each byte copied once:
//! page-locked host memory straight to a GPU by DMA on its copy stream,
//! other host memory through the pinned staging pool (the host fills one
//! slot while the copy engine drains the previous one), GPU memory peer to
//! peer or downloaded. Copies are only enqueued: the bytes arrive with the
//! event of their copy ([`Arrival`]), and whoever computes with them waits
//! on it, on the compute stream, when it takes them.
//!
//! Loading a checkpoint onto a GPU ([`GpuLoad`]) uploads the raw bytes and,
//! when the dtype changes, casts them on the GPU after the upload (the
//! host casts for emulated GPUs, and for a CUDA GPU that cannot run its
//! kernels: same bits either way).

use std::sync::Arc;

use bm_device::{Device, DeviceBuffer, DeviceSet, Event, Gpu, GpuKind, PinnedPool};
use bm_tensor::{DType, HostBuffer, cast_into};

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

/// `len` bytes (at least one) of `gpu`'s memory for `what`.
fn alloc(what: &str, gpu: &Gpu, len: usize) -> Result<DeviceBuffer> {
    gpu.alloc(len.max(1)).map_err(|e| Error::device(what, e))
}

/// Enqueues a copy of host `src` into `dst` at `offset` on the copy stream
/// of `dst`'s GPU: through the staging pool when there is one (returns once
/// `src` was read), else a synchronous pageable copy.
fn upload_into(
    what: &str,
    dst: &mut DeviceBuffer,
    offset: usize,
    src: &[u8],
    pool: Option<&PinnedPool>,
) -> Result<Option<Event>> {
    if src.is_empty() {
        return Ok(None);
    }
    let copy = dst.gpu().copy_stream().clone();
    match pool {
        Some(pool) => dst
            .upload(offset, src, pool, &copy)
            .map(Some)
            .map_err(|e| Error::device(what, e)),
        None => dst
            .copy_from_host(offset, src)
            .map(|()| None)
            .map_err(|e| Error::device(what, e)),
    }
}

/// Where host bytes go on their way to a device: `(offset, piece)`.
pub(crate) type Sink<'a> = dyn FnMut(usize, &[u8]) -> Result<()> + 'a;

/// Host bytes produced piece by piece (a cast) onto `device`: `len` bytes
/// that `fill` hands, with their offsets, to its sink, copied into a new
/// host buffer for the CPU, or into a new allocation on a GPU through the
/// staging pool on the GPU's copy stream.
pub(crate) fn upload_chunks(
    what: &str,
    len: usize,
    device: Device,
    devices: &DeviceSet,
    pool: Option<&PinnedPool>,
    fill: impl FnOnce(&mut Sink<'_>) -> Result<()>,
) -> Result<Arrival> {
    if device == Device::Cpu {
        let mut buf = HostBuffer::zeroed(len).map_err(|e| Error::tensor(what, e))?;
        let dst = buf.as_mut_bytes();
        fill(&mut |offset, piece| {
            dst.get_mut(offset..offset + piece.len())
                .ok_or_else(|| Error::BadOption(format!("{what}: more bytes than {len}")))?
                .copy_from_slice(piece);
            Ok(())
        })?;
        return Ok(Arrival::ready(Arc::new(Bytes::Host(buf))));
    }
    let gpu = gpu_of(what, device, devices)?;
    let mut buf = alloc(what, &gpu, len)?;
    let mut ready = None;
    fill(&mut |offset, piece| {
        ready = upload_into(what, &mut buf, offset, piece, pool)?.or(ready.take());
        Ok(())
    })?;
    Ok(Arrival {
        bytes: Arc::new(Bytes::Device(buf)),
        ready,
    })
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
/// once: page-locked memory straight to the GPU by DMA on its copy stream
/// (no staging copy); other host memory through the staging pool; GPU
/// memory to another GPU on the destination's copy stream, or downloaded
/// to the host. Bytes already on `device` are shared, not copied. The copy
/// may still be in flight on return: see [`Arrival`].
pub(crate) fn to_device(
    what: &str,
    bytes: &Arc<Bytes>,
    device: Device,
    devices: &DeviceSet,
    pool: Option<&PinnedPool>,
) -> Result<Arrival> {
    if bytes.device() == device {
        return Ok(Arrival::ready(Arc::clone(bytes)));
    }
    let device_copy = |dst: DeviceBuffer, ready: bm_device::Result<Event>| {
        Ok(Arrival {
            ready: Some(ready.map_err(|e| Error::device(what, e))?),
            bytes: Arc::new(Bytes::Device(dst)),
        })
    };
    match (bytes.as_ref(), device) {
        (Bytes::Pinned(src), Device::Gpu(_)) => {
            let gpu = gpu_of(what, device, devices)?;
            let mut dst = alloc(what, &gpu, src.len())?;
            let ready = dst.copy_from_pinned(0, src, 0..src.len(), gpu.copy_stream());
            device_copy(dst, ready)
        }
        (Bytes::Device(src), Device::Gpu(_)) => {
            let gpu = gpu_of(what, device, devices)?;
            let mut dst = alloc(what, &gpu, src.len())?;
            let ready = dst.copy_from_device(0, src, 0..src.len(), gpu.copy_stream());
            device_copy(dst, ready)
        }
        (Bytes::Device(_), Device::Cpu) => {
            let host = bytes.to_host()?;
            let buf = HostBuffer::from_bytes(&host).map_err(|e| Error::tensor(what, e))?;
            Ok(Arrival::ready(Arc::new(Bytes::Host(buf))))
        }
        (host, _) => {
            let src = host.to_host()?;
            upload_chunks(what, src.len(), device, devices, pool, |sink| sink(0, &src))
        }
    }
}

/// Moves `bytes` to `device` for use by the calling thread (a copy; shared
/// when already there): [`to_device`], with the destination's compute
/// stream ordered after the copy.
pub(crate) fn move_bytes(
    what: &str,
    bytes: &Arc<Bytes>,
    device: Device,
    devices: &DeviceSet,
    pool: Option<&PinnedPool>,
) -> Result<Arc<Bytes>> {
    let arrival = to_device(what, bytes, device, devices, pool)?;
    arrival.wait_for_compute(what)?;
    Ok(arrival.bytes)
}

/// Source bytes converted per chunk by a GPU cast: two device scratch
/// buffers of this size let the upload of one chunk overlap the cast of
/// the previous one, with bounded extra device memory.
pub const GPU_CAST_CHUNK: usize = 16 << 20;

/// How one GPU converts dtypes during a load.
enum CastOn {
    /// Not needed yet.
    Undecided,
    /// On the GPU.
    Gpu(GpuCaster),
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
        Some(GpuCaster {
            gpu: gpu.clone(),
            scratch: [
                gpu.alloc(GPU_CAST_CHUNK).ok()?,
                gpu.alloc(GPU_CAST_CHUNK).ok()?,
            ],
            next: 0,
            proven: false,
        })
    }

    /// `src` (`from` elements) into `dst` as `to` elements.
    fn cast(
        &mut self,
        name: &str,
        src: &[u8],
        from: DType,
        dst: &mut DeviceBuffer,
        to: DType,
        pool: Option<&PinnedPool>,
    ) -> Result<()> {
        let from_size = from.size_in_bytes();
        let count = src.len() / from_size;
        let per_chunk = GPU_CAST_CHUNK / from_size;
        for start in (0..count).step_by(per_chunk) {
            let n = per_chunk.min(count - start);
            let buf = &mut self.scratch[self.next];
            self.next = 1 - self.next;
            let raw = &src[start * from_size..(start + n) * from_size];
            if let Some(uploaded) = upload_into(name, buf, 0, raw, pool)? {
                self.gpu
                    .compute_stream()
                    .wait(&uploaded)
                    .map_err(|e| Error::device(name, e))?;
            }
            self.gpu
                .cast_exact(buf, from, dst, to, n, start)
                .map_err(|e| Error::device(name, e))?;
        }
        self.proven = true;
        Ok(())
    }
}

/// Loading tensors onto GPUs: raw bytes uploaded on each GPU's copy
/// stream, converted on the GPU when the dtype changes, and everything
/// waited for once, at [`GpuLoad::finish`].
pub(crate) struct GpuLoad<'a> {
    devices: &'a DeviceSet,
    pool: Option<&'a PinnedPool>,
    /// Per GPU ordinal: how it casts, and whether anything was enqueued.
    gpus: Vec<(CastOn, bool)>,
}

impl<'a> GpuLoad<'a> {
    pub(crate) fn new(devices: &'a DeviceSet, pool: Option<&'a PinnedPool>) -> GpuLoad<'a> {
        GpuLoad {
            devices,
            pool,
            gpus: (0..devices.gpu_count())
                .map(|_| (CastOn::Undecided, false))
                .collect(),
        }
    }

    /// Tensor `name`, stored as `src` in `from`, onto GPU `device` in `to`.
    /// The copies (and the cast) may still be running on return.
    pub(crate) fn write(
        &mut self,
        name: &str,
        src: &[u8],
        from: DType,
        to: DType,
        device: Device,
    ) -> Result<Bytes> {
        let gpu = gpu_of(name, device, self.devices)?;
        let count = src.len() / from.size_in_bytes().max(1);
        let mut dst = alloc(name, &gpu, count * to.size_in_bytes())?;
        let (cast_on, used) = &mut self.gpus[gpu.ordinal()];
        *used = true;
        if from == to {
            upload_into(name, &mut dst, 0, src, self.pool)?;
            return Ok(Bytes::Device(dst));
        }
        let kernels = [DType::F32, DType::F16, DType::BF16];
        if kernels.contains(&from) && kernels.contains(&to) {
            if matches!(cast_on, CastOn::Undecided) {
                *cast_on = GpuCaster::new(&gpu).map_or(CastOn::Host, CastOn::Gpu);
            }
            if let CastOn::Gpu(caster) = cast_on {
                match caster.cast(name, src, from, &mut dst, to, self.pool) {
                    Ok(()) => return Ok(Bytes::Device(dst)),
                    // The first cast shows whether this GPU can run its
                    // kernels at all (NVRTC may be missing): if not, the
                    // host casts this tensor and every later one.
                    Err(_) if !caster.proven => *cast_on = CastOn::Host,
                    Err(e) => return Err(e),
                }
            }
        }
        cast_chunks(name, src, from, to, &mut |offset, piece| {
            upload_into(name, &mut dst, offset, piece, self.pool).map(drop)
        })?;
        Ok(Bytes::Device(dst))
    }

    /// Waits until every copy and cast enqueued by [`GpuLoad::write`] has
    /// completed, and frees the cast scratch buffers.
    pub(crate) fn finish(self) -> Result<()> {
        for (ordinal, (_, used)) in self.gpus.iter().enumerate() {
            if !used {
                continue;
            }
            let gpu = gpu_of("the loaded tensors", Device::Gpu(ordinal), self.devices)?;
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

/// Runs `sink(offset, bytes)` over `src` converted from `from` to `to`,
/// [`STAGING_BYTES`] at a time (borrowing `src` when no cast is needed).
pub(crate) fn cast_chunks(
    name: &str,
    src: &[u8],
    from: DType,
    to: DType,
    sink: &mut Sink<'_>,
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
