//! A one-paragraph error instead of a bare "Bus error" when a file read
//! through a memory map shrinks while a command runs.
//!
//! Checkpoints and offload files are mapped. When another program truncates
//! one (rewriting a checkpoint in place does), reading a lost page raises
//! SIGBUS, which kills the process without a word. bm-shard checks sizes
//! when it opens files and before it hands out bytes, but a file can still
//! shrink after the check, while its bytes are being read. Execution cannot
//! resume after such a fault (Rust has no safe way back into the code that
//! faulted), so the robust answer is to say what happened and stop: the
//! handler finds the file mapped at the faulting address in
//! `/proc/self/maps`, prints the error naming it, and exits with status 1
//! like any other error. It uses only async-signal-safe calls (`open`,
//! `read`, `write`, `close`, `_exit`) and no allocation. A SIGBUS that is
//! not about a mapped file goes to the handler that was there before.

/// Installs the handler (Linux; elsewhere a fault keeps the default
/// action).
pub fn install() {
    #[cfg(target_os = "linux")]
    linux::install();
}

#[cfg(target_os = "linux")]
mod linux {
    use std::ffi::{c_int, c_void};
    use std::sync::OnceLock;

    /// The disposition before ours, for faults that are not ours to report.
    static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

    /// Room for the path of the mapped file in the message.
    const PATH_MAX: usize = 4096;

    pub(super) fn install() {
        // SAFETY: plain sigaction calls on zero-initialised structs (a valid
        // state for them); the handler only makes async-signal-safe calls.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigbus as *const () as usize;
            // Not SA_ONSTACK: the fault is a read, not a stack overflow, and
            // the buffers below need more than a small alternate stack.
            action.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&mut action.sa_mask);
            let mut previous: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, &action, &mut previous) == 0 {
                let _ = PREVIOUS.set(previous);
            }
        }
    }

    extern "C" fn on_sigbus(_signal: c_int, info: *mut libc::siginfo_t, _context: *mut c_void) {
        // SAFETY: the kernel passes a valid siginfo_t to an SA_SIGINFO
        // handler; si_addr is the faulting address for SIGBUS.
        let (addr, code) = unsafe { ((*info).si_addr() as usize, (*info).si_code) };
        let mut path = [0u8; PATH_MAX];
        if let Some(len) = mapped_file_at(addr, &mut path) {
            write_stderr(b"error: ");
            write_stderr(&path[..len]);
            write_stderr(
                b": the file shrank while bigmodel was reading it through a memory map (another program truncated or rewrote it); checkpoint and offload files must not change while a command runs\n",
            );
            // SAFETY: _exit is async-signal-safe and ends the process at once.
            unsafe { libc::_exit(1) };
        }
        // Not ours: put the previous disposition back. A fault recurs when
        // this returns and goes to it; a SIGBUS sent by kill() is raised
        // again (it stays pending until this handler returns).
        // SAFETY: sigaction and raise are async-signal-safe; the previous
        // action was filled in by the kernel.
        unsafe {
            let mut default: libc::sigaction = std::mem::zeroed();
            default.sa_sigaction = libc::SIG_DFL;
            let previous = PREVIOUS.get().unwrap_or(&default);
            libc::sigaction(libc::SIGBUS, previous, std::ptr::null_mut());
            if code <= 0 {
                libc::raise(libc::SIGBUS);
            }
        }
    }

    fn write_stderr(mut bytes: &[u8]) {
        while !bytes.is_empty() {
            // SAFETY: writes from a live slice of the given length.
            let n = unsafe { libc::write(2, bytes.as_ptr().cast(), bytes.len()) };
            if n <= 0 {
                return;
            }
            bytes = &bytes[n as usize..];
        }
    }

    /// Copies into `out` the path of the file mapped at `addr`, read from
    /// `/proc/self/maps` without allocating; returns its length.
    fn mapped_file_at(addr: usize, out: &mut [u8; PATH_MAX]) -> Option<usize> {
        // SAFETY: a NUL-terminated literal path; the descriptor is closed below.
        let fd = unsafe {
            libc::open(
                c"/proc/self/maps".as_ptr(),
                libc::O_RDONLY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return None;
        }
        let mut chunk = [0u8; 1024];
        let mut line = [0u8; PATH_MAX + 128];
        let mut len = 0;
        let mut found = None;
        'read: loop {
            // SAFETY: reads into a live buffer of the given length.
            let n = unsafe { libc::read(fd, chunk.as_mut_ptr().cast(), chunk.len()) };
            if n <= 0 {
                break;
            }
            for &b in &chunk[..n as usize] {
                if b == b'\n' {
                    found = file_of_line(&line[..len], addr, out);
                    if found.is_some() {
                        break 'read;
                    }
                    len = 0;
                } else if len < line.len() {
                    line[len] = b;
                    len += 1;
                }
            }
        }
        // SAFETY: fd was opened above and is closed once.
        unsafe { libc::close(fd) };
        found
    }

    /// For a `/proc/self/maps` line `start-end perms offset dev inode path`
    /// whose range holds `addr` and which maps a file: the path, copied
    /// into `out` (cut to its size).
    pub(super) fn file_of_line(line: &[u8], addr: usize, out: &mut [u8]) -> Option<usize> {
        let (start, rest) = hex(line)?;
        let (end, rest) = hex(rest.strip_prefix(b"-")?)?;
        if !(start <= addr && addr < end) {
            return None;
        }
        // Skip perms, offset, device and inode.
        let mut rest = rest;
        for _ in 0..4 {
            rest = trim_start(rest);
            let field = rest.iter().position(|&b| b == b' ').unwrap_or(rest.len());
            rest = &rest[field..];
        }
        let path = trim_start(rest);
        if path.first() != Some(&b'/') {
            return None; // anonymous, [heap], [stack], ...
        }
        let n = path.len().min(out.len());
        out[..n].copy_from_slice(&path[..n]);
        Some(n)
    }

    fn trim_start(bytes: &[u8]) -> &[u8] {
        let n = bytes.iter().take_while(|&&b| b == b' ').count();
        &bytes[n..]
    }

    fn hex(bytes: &[u8]) -> Option<(usize, &[u8])> {
        let digits = bytes.iter().take_while(|b| b.is_ascii_hexdigit()).count();
        if digits == 0 || digits > 2 * std::mem::size_of::<usize>() {
            return None;
        }
        let mut value = 0usize;
        for &b in &bytes[..digits] {
            let d = (b as char).to_digit(16)? as usize;
            value = value << 4 | d;
        }
        Some((value, &bytes[digits..]))
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::io::Write;
    use std::process::Command;

    #[test]
    fn map_lines_give_the_file_at_an_address() {
        let line =
            b"7f12a000-7f12c000 r--s 00001000 08:01 1234                       /data/m.safetensors";
        let mut out = [0u8; 64];
        let n = linux::file_of_line(line, 0x7f12b000, &mut out).unwrap();
        assert_eq!(&out[..n], b"/data/m.safetensors");
        assert_eq!(linux::file_of_line(line, 0x7f12c000, &mut out), None);
        let heap = b"55d0c000-55d2d000 rw-p 00000000 00:00 0                          [heap]";
        assert_eq!(linux::file_of_line(heap, 0x55d0c000, &mut out), None);
        assert_eq!(linux::file_of_line(b"garbage", 0, &mut out), None);
    }

    /// Runs in a child process (this test binary again): maps a file,
    /// truncates it, reads it.
    #[test]
    fn a_read_of_a_truncated_mapping_is_an_error_naming_the_file() {
        if let Some(path) = std::env::var_os("BM_SIGBUS_CHILD_FILE") {
            install();
            let view = bigmodel::tensor::MmapView::open(&path).unwrap();
            std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .unwrap()
                .set_len(0)
                .unwrap();
            let sum: u64 = view.as_bytes().iter().map(|&b| u64::from(b)).sum();
            panic!("read {sum} from a truncated mapping without a fault");
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shrinking.safetensors");
        std::fs::File::create(&path)
            .unwrap()
            .write_all(&[1u8; 1 << 16])
            .unwrap();
        let out = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "sigbus::tests::a_read_of_a_truncated_mapping_is_an_error_naming_the_file",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("BM_SIGBUS_CHILD_FILE", &path)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains(&format!(
                "error: {}: the file shrank while bigmodel was reading it",
                path.canonicalize().unwrap().display()
            )),
            "{stderr}"
        );
    }
}
