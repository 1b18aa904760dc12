//! Folder locks where the folder cannot be written: a read-only mount (in a
//! private mount namespace, where `unshare` is allowed; the case prints why
//! it is skipped otherwise).
#![cfg(target_os = "linux")]

use std::process::Command;

use bm_shard::{FolderLock, LOCK_FILE, Sharing};

const CHILD: &str = "BM_LOCKS_READ_ONLY_CHILD";

/// In the child: the folder is mounted read-only.
fn child(folder: &str) {
    let folder = std::path::Path::new(folder);
    let lock = FolderLock::acquire(folder, &Sharing::default()).unwrap();
    assert!(!folder.join(LOCK_FILE).exists());
    drop(lock);
    println!("child: locked nothing, read on");
}

#[test]
fn a_read_only_folder_is_read_without_a_lock() {
    if let Ok(folder) = std::env::var(CHILD) {
        return child(&folder);
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("index.json"), b"{}").unwrap();
    let d = dir.path().display();
    let exe = std::env::current_exe().unwrap();
    let script = format!(
        "mount --bind {d} {d} && mount -o remount,ro,bind {d} {d} || exit 99
         {CHILD}={d} {} --exact a_read_only_folder_is_read_without_a_lock --nocapture --test-threads=1",
        exe.display()
    );
    let mut ran = None;
    for flags in [&["--mount"][..], &["--map-root-user", "--mount"]] {
        let out = Command::new("unshare")
            .args(flags)
            .args(["sh", "-c", &script])
            .output();
        if let Ok(out) = out
            && out.status.code() != Some(99)
            && !String::from_utf8_lossy(&out.stderr).contains("unshare failed")
        {
            ran = Some(out);
            break;
        }
    }
    let Some(out) = ran else {
        eprintln!("skipped: no mount namespace with a read-only bind mount here");
        return;
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("child: locked nothing"),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
