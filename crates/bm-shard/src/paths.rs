//! The one rule for files we open because a file told us to, and the one
//! way we open any file for reading.
//!
//! An index (`*.index.json`, an offload `index.json`) names files. A name is
//! first checked as text (not empty, not absolute, no `..`, no NUL), then
//! joined to the folder it is relative to, resolved through every symbolic
//! link, and accepted only when the result is a regular file inside that
//! folder — or, for a Hugging Face hub cache snapshot
//! (`models--ORG--NAME/snapshots/REV/`, where every file is a link to
//! `../../blobs/HASH`), inside the `models--*` repository folder that holds
//! `blobs/`, as transformers reads it. Nothing is opened before the name
//! passes, so a refused name never shows a byte of what it points to.
//!
//! Every file is opened with [`open_regular`], which refuses FIFOs, sockets
//! and devices before opening them (opening a FIFO blocks until a writer
//! appears) and checks after opening that it got the very file it looked
//! at, so a name swapped in between is caught.

use std::fs::{File, Metadata};
use std::path::{Component, Path, PathBuf};

use crate::Error;

/// A file an index named, resolved and checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    /// The folder joined with the name as written (`.` components
    /// dropped): the path errors and reports show.
    pub named: PathBuf,
    /// The same file with every link resolved: the path that is opened.
    pub real: PathBuf,
    /// Device and inode of the file checked (Unix), so that opening it can
    /// tell whether it is still the same file.
    id: Option<(u64, u64)>,
}

impl Resolved {
    /// Opens the resolved file for reading; refuses it if the path now
    /// leads to another file than the one checked.
    pub fn open(&self) -> Result<File, Error> {
        let file = File::open(&self.real).map_err(|e| Error::io(&self.named, "opening", e))?;
        let meta = file
            .metadata()
            .map_err(|e| Error::io(&self.named, "reading the type of", e))?;
        if !meta.is_file() || file_id(&meta) != self.id {
            return Err(Error::checkpoint(
                &self.named,
                "was replaced while being opened; refusing to read it",
            ));
        }
        Ok(file)
    }
}

/// The name with `.` components and doubled separators dropped, so that
/// `./s1.safetensors` and `s1.safetensors` are one file.
pub(crate) fn normalize(name: &str) -> String {
    Path::new(name)
        .components()
        .filter(|c| *c != Component::CurDir)
        .collect::<PathBuf>()
        .to_string_lossy()
        .into_owned()
}

/// Checks a name read from an index as text: it must stay inside the
/// folder it is relative to whatever the folder holds. The error completes
/// "(who names it), which ...".
pub(crate) fn check_name(name: &str) -> Result<(), String> {
    let refuse = |why: &str| format!("{why}; refusing to read it");
    if name.is_empty() {
        return Err(refuse("is empty"));
    }
    if name.contains('\0') {
        return Err(refuse("contains a NUL byte"));
    }
    let p = Path::new(name);
    if p.is_absolute() || p.has_root() || name.starts_with(['/', '\\']) {
        return Err(refuse("is an absolute path"));
    }
    for c in p.components() {
        match c {
            Component::ParentDir => return Err(refuse("contains `..`")),
            Component::Prefix(_) | Component::RootDir => {
                return Err(refuse("is an absolute path"));
            }
            Component::CurDir | Component::Normal(_) => {}
        }
    }
    // Windows separators are not separators on Unix, but a `..` between them
    // is still refused: such a name is never a legitimate shard.
    if name.split(['/', '\\']).any(|part| part == "..") {
        return Err(refuse("contains `..`"));
    }
    if normalize(name).is_empty() {
        return Err(refuse("names no file"));
    }
    Ok(())
}

/// Resolves `name` inside `folder`: see the module docs. Only metadata is
/// touched, never contents. The error completes "(who names it), which
/// ...". To resolve many names in one folder, use [`Folder`].
pub fn resolve_in_folder(folder: &Path, name: &str) -> Result<Resolved, String> {
    Folder::new(folder)?.resolve(name)
}

/// A folder names are resolved in, resolved itself once (an offload folder
/// or an index may name a million files).
pub(crate) struct Folder<'a> {
    folder: &'a Path,
    real: PathBuf,
    hub_repository: Option<PathBuf>,
}

impl<'a> Folder<'a> {
    /// The error completes "(who names a file in it), which ...".
    pub(crate) fn new(folder: &'a Path) -> Result<Self, String> {
        let real = folder
            .canonicalize()
            .map_err(|e| format!("cannot be resolved ({}: {e})", folder.display()))?;
        let hub_repository = hub_repository(&real).map(Path::to_path_buf);
        Ok(Folder {
            folder,
            real,
            hub_repository,
        })
    }

    /// [`resolve_in_folder`] for this folder.
    pub(crate) fn resolve(&self, name: &str) -> Result<Resolved, String> {
        check_name(name)?;
        let named = self.folder.join(normalize(name));
        let real = match named.canonicalize() {
            Ok(p) => p,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let why = if std::fs::symlink_metadata(&named).is_ok() {
                    "is a symbolic link to nothing"
                } else {
                    "does not exist"
                };
                return Err(format!("{why} ({})", named.display()));
            }
            Err(e) => return Err(format!("cannot be resolved ({}: {e})", named.display())),
        };
        let inside = real.starts_with(&self.real)
            || self
                .hub_repository
                .as_ref()
                .is_some_and(|repo| real.starts_with(repo));
        if !inside {
            return Err(format!(
                "resolves to {}, outside the folder {}; refusing to read it",
                real.display(),
                self.real.display()
            ));
        }
        let meta = std::fs::metadata(&real)
            .map_err(|e| format!("cannot be examined ({}: {e})", named.display()))?;
        if !meta.is_file() {
            return Err(format!("is {}, not a file", kind(&meta)));
        }
        Ok(Resolved {
            named,
            real,
            id: file_id(&meta),
        })
    }
}

/// The Hugging Face hub cache repository holding `folder` when `folder`
/// (resolved) lies in one of its snapshots: the `models--*` ancestor whose
/// `snapshots/` leads to `folder` and which holds a `blobs/` folder.
fn hub_repository(folder: &Path) -> Option<&Path> {
    let mut child: Option<&Path> = None;
    for ancestor in folder.ancestors() {
        let is_repo = ancestor
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("models--") && n.len() > "models--".len());
        if is_repo {
            let via_snapshots = child
                .and_then(Path::file_name)
                .is_some_and(|n| n == "snapshots");
            return (via_snapshots && ancestor.join("blobs").is_dir()).then_some(ancestor);
        }
        child = Some(ancestor);
    }
    None
}

/// Whether `path` is there (links followed): `false` only when it, or a
/// folder on the way, does not exist. Any other failure to look (a folder
/// that may not be entered) is an error naming the path, so a file that
/// cannot be read is never taken for one that is absent.
pub fn exists(path: &Path) -> Result<bool, Error> {
    use std::io::ErrorKind;
    match std::fs::metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::NotADirectory) => Ok(false),
        Err(e) => Err(Error::io(path, "looking for", e)),
    }
}

/// Opens `path` for reading if it is a regular file (links followed). A
/// FIFO, socket or device is refused before it is opened, a folder too
/// (say where one is expected by checking first). On Unix the file opened
/// must be the one looked at (same device and inode).
pub fn open_regular(path: &Path) -> Result<File, Error> {
    let before = std::fs::metadata(path).map_err(|e| Error::io(path, "opening", e))?;
    if !before.is_file() {
        return Err(Error::checkpoint(
            path,
            format!(
                "is {}, not a regular file; refusing to open it",
                kind(&before)
            ),
        ));
    }
    let file = File::open(path).map_err(|e| Error::io(path, "opening", e))?;
    let after = file
        .metadata()
        .map_err(|e| Error::io(path, "reading the type of", e))?;
    if !after.is_file() || file_id(&before) != file_id(&after) {
        return Err(Error::checkpoint(
            path,
            "was replaced while being opened; refusing to read it",
        ));
    }
    Ok(file)
}

/// Reads the whole of a regular file (see [`open_regular`]).
pub fn read_regular(path: &Path) -> Result<Vec<u8>, Error> {
    use std::io::Read;
    let mut file = open_regular(path)?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)
        .map_err(|e| Error::io(path, "reading", e))?;
    Ok(bytes)
}

/// Device and inode (Unix): what makes a file the same file.
#[cfg(unix)]
fn file_id(meta: &Metadata) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    Some((meta.dev(), meta.ino()))
}

#[cfg(not(unix))]
fn file_id(_: &Metadata) -> Option<(u64, u64)> {
    None
}

/// What a non-regular file is, for messages.
fn kind(meta: &Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_dir() {
        return "a folder";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_socket() {
            return "a socket";
        }
        if t.is_block_device() || t.is_char_device() {
            return "a device";
        }
    }
    "not a regular file"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exists_tells_absent_from_present() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        assert!(exists(&file).unwrap());
        assert!(exists(dir.path()).unwrap());
        assert!(!exists(&dir.path().join("nothing")).unwrap());
        // Under a file: not there, not an error.
        assert!(!exists(&file.join("below")).unwrap());
        // (A folder that may not be entered is an error naming the path;
        // the CLI's hostile_limits test checks it as a user it binds.)
    }

    #[test]
    fn names_that_leave_the_folder_are_refused_as_text() {
        for (name, why) in [
            ("/etc/passwd", "absolute"),
            ("../x.safetensors", "`..`"),
            ("a/../../x", "`..`"),
            ("..\\x", "`..`"),
            ("", "empty"),
            (".", "names no file"),
            ("a\0b", "NUL"),
        ] {
            let e = check_name(name).unwrap_err();
            assert!(
                e.contains(why) && e.ends_with("refusing to read it"),
                "{name:?}: {e}"
            );
        }
        assert!(check_name("./sub/x.safetensors").is_ok());
        assert_eq!(normalize("./sub//x.safetensors"), "sub/x.safetensors");
    }

    #[cfg(unix)]
    #[test]
    fn links_resolve_inside_the_folder_or_a_hub_repository() {
        use std::os::unix::fs::symlink;
        let root = tempfile::tempdir().unwrap();
        let repo = root.path().join("models--org--tiny");
        let snap = repo.join("snapshots/abc123");
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::create_dir_all(repo.join("blobs")).unwrap();
        std::fs::write(repo.join("blobs/f00d"), b"x").unwrap();
        symlink("../../blobs/f00d", snap.join("model.safetensors")).unwrap();
        std::fs::write(root.path().join("secret"), b"s").unwrap();
        symlink("../../../secret", snap.join("evil.safetensors")).unwrap();

        let ok = resolve_in_folder(&snap, "./model.safetensors").unwrap();
        assert_eq!(ok.named, snap.join("model.safetensors"));
        assert_eq!(ok.real, repo.join("blobs/f00d").canonicalize().unwrap());
        ok.open().unwrap();
        let e = resolve_in_folder(&snap, "evil.safetensors").unwrap_err();
        assert!(e.contains("outside the folder"), "{e}");

        // The same layout outside a `models--*` folder is refused.
        let plain = root.path().join("plain/snapshots/abc");
        std::fs::create_dir_all(&plain).unwrap();
        std::fs::create_dir_all(root.path().join("plain/blobs")).unwrap();
        std::fs::write(root.path().join("plain/blobs/f00d"), b"x").unwrap();
        symlink("../../blobs/f00d", plain.join("model.safetensors")).unwrap();
        let e = resolve_in_folder(&plain, "model.safetensors").unwrap_err();
        assert!(e.contains("outside the folder"), "{e}");

        symlink("nowhere", snap.join("dangling.safetensors")).unwrap();
        let e = resolve_in_folder(&snap, "dangling.safetensors").unwrap_err();
        assert!(e.contains("a symbolic link to nothing"), "{e}");
        std::fs::create_dir(snap.join("dir.safetensors")).unwrap();
        let e = resolve_in_folder(&snap, "dir.safetensors").unwrap_err();
        assert!(e.contains("is a folder, not a file"), "{e}");
    }

    #[cfg(unix)]
    #[test]
    fn a_file_swapped_after_the_check_is_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.safetensors");
        std::fs::write(&path, b"checked").unwrap();
        let resolved = resolve_in_folder(dir.path(), "a.safetensors").unwrap();
        // Made while the checked file still exists, so its inode differs.
        std::fs::write(dir.path().join("other"), b"other").unwrap();
        std::fs::rename(dir.path().join("other"), &path).unwrap();
        let e = resolved.open().unwrap_err().to_string();
        assert!(e.contains("was replaced while being opened"), "{e}");
    }

    #[cfg(unix)]
    #[test]
    fn fifos_are_refused_before_opening() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("ckpt.safetensors");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if !made.is_ok_and(|s| s.success()) {
            eprintln!("skipped: no mkfifo");
            return;
        }
        // Opening would block forever; the check comes first.
        let e = open_regular(&fifo).unwrap_err().to_string();
        assert!(e.contains("is a FIFO, not a regular file"), "{e}");
        let e = resolve_in_folder(dir.path(), "ckpt.safetensors").unwrap_err();
        assert!(e.contains("is a FIFO, not a file"), "{e}");
    }
}
