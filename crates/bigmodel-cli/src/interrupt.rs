//! Ctrl-C, SIGTERM and SIGHUP: remove what is being written, then exit
//! with 128 + the signal's number (130, 143, 129), as a shell reports a
//! process killed by it.
//!
//! Without this, a signal kills the process where it stands and leaves its
//! temporaries behind (a shard being written, an offload `.dat` file, the
//! calibration probe). The handler itself only writes the signal's number
//! to a pipe (`write` is async-signal-safe; nothing else is done there); a
//! thread waiting on the pipe does the rest from ordinary code: it calls
//! [`bigmodel::shard::remove_in_flight`], which removes every temporary
//! this process has in flight and the lock files it holds and keeps the
//! registry locked so that no writer creates or commits another, then ends
//! the process with `_exit`. The locks themselves die with the process.
//!
//! A signal that was ignored when the process started (`nohup`, a
//! background job of a non-interactive shell) stays ignored. The signal
//! mask is left alone, so programs this one starts get the default
//! dispositions back.

/// Installs the handlers and starts the thread (Unix; elsewhere a signal
/// keeps its default action).
pub fn install() {
    #[cfg(unix)]
    unix::install();
}

#[cfg(unix)]
mod unix {
    use std::ffi::c_int;
    use std::sync::atomic::{AtomicI32, Ordering};

    /// The pipe's write end, for the handler; -1 until installed.
    static WRITE_END: AtomicI32 = AtomicI32::new(-1);

    const SIGNALS: [c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

    pub(super) fn install() {
        let mut ends = [0 as c_int; 2];
        // SAFETY: pipe fills the two-element array it is given.
        if unsafe { libc::pipe(ends.as_mut_ptr()) } != 0 {
            return;
        }
        for fd in ends {
            // SAFETY: fcntl on descriptors just created; programs this
            // one starts must not inherit them.
            unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
        }
        let [read_end, write_end] = ends;
        WRITE_END.store(write_end, Ordering::SeqCst);
        let started = std::thread::Builder::new()
            .name("interrupts".into())
            .spawn(move || wait_and_exit(read_end));
        if started.is_err() {
            return;
        }
        for signal in SIGNALS {
            // SAFETY: plain sigaction calls on zero-initialised structs (a
            // valid state for them); the handler only calls write.
            unsafe {
                let mut previous: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(signal, std::ptr::null(), &mut previous) != 0
                    || previous.sa_sigaction == libc::SIG_IGN
                {
                    continue;
                }
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_signal as *const () as usize;
                action.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut action.sa_mask);
                libc::sigaction(signal, &action, std::ptr::null_mut());
            }
        }
    }

    extern "C" fn on_signal(signal: c_int) {
        let byte = signal as u8;
        // SAFETY: write is async-signal-safe; it reads one byte from a
        // live local. errno is saved and restored around it, as the
        // interrupted code may be about to read it.
        unsafe {
            let errno = *errno_location();
            libc::write(
                WRITE_END.load(Ordering::Relaxed),
                (&byte as *const u8).cast(),
                1,
            );
            *errno_location() = errno;
        }
    }

    #[cfg(any(target_os = "linux", target_os = "android"))]
    unsafe fn errno_location() -> *mut c_int {
        // SAFETY: returns this thread's errno slot.
        unsafe { libc::__errno_location() }
    }

    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    unsafe fn errno_location() -> *mut c_int {
        // SAFETY: returns this thread's errno slot.
        unsafe { libc::__error() }
    }

    /// Waits for a signal's number on the pipe, cleans up and exits.
    fn wait_and_exit(read_end: c_int) {
        let mut byte = 0u8;
        loop {
            // SAFETY: reads one byte into a live local.
            let n = unsafe { libc::read(read_end, (&mut byte as *mut u8).cast(), 1) };
            if n == 1 {
                break;
            }
            let interrupted =
                std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted;
            if n == 0 || !interrupted {
                return;
            }
        }
        bigmodel::shard::remove_in_flight();
        // SAFETY: _exit ends the process at once, without running exit
        // handlers while other threads may still be writing.
        unsafe { libc::_exit(128 + c_int::from(byte)) }
    }
}
