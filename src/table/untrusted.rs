//! The one way to open what other local users can touch: the thread tables in `/dev/shm` (or the
//! lock directory) and anything inside a container's root (`/proc/<pid>/root/...`). The library
//! (its own table, the stale tables it removes) and `tllm-affinity ps` open through here alone.
//!
//! The rules (docs/security.md):
//! - no link is followed: the last component is opened with `O_PATH | O_NOFOLLOW`, so a symbolic
//!   link is seen as one and refused; inside a container's root the directory is resolved with
//!   `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)`, or, on a kernel
//!   without `openat2` (`ENOSYS`, before 5.6), one `O_NOFOLLOW` component at a time;
//! - nothing but a regular file is ever really opened: the `O_PATH` descriptor (which opens no
//!   device, FIFO or socket: no driver's `open` runs) is checked with `fstat` — a regular file,
//!   of the expected owner, with one name (`st_nlink == 1`), within a size cap — and only then
//!   reopened for reading through `/proc/self/fd`, which names that very inode (never the path
//!   again), with `O_NONBLOCK | O_CLOEXEC`; the reopened descriptor is checked to be the same
//!   inode.
//!
//! The raw calls live here, each `unsafe` block with its `SAFETY` line; the rest is safe.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};

/// What a file must be to be believed.
#[derive(Debug, Clone, Copy)]
pub struct Rules {
    /// Its owner (`st_uid`).
    pub owner: u32,
    /// Its largest size in bytes: a bigger file is refused unopened.
    pub max_bytes: u64,
}

/// What `fstat` said of an opened file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileFacts {
    pub owner: u32,
    pub bytes: u64,
    pub device: u64,
    pub inode: u64,
    /// Last modification, seconds since the epoch.
    pub modified: i64,
}

/// A directory held open (`O_PATH`): every name below is looked up in it, never by path again.
#[derive(Debug)]
pub struct Dir {
    fd: OwnedFd,
}

fn cstring(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// `name` as one path component: no `/`, not `.` or `..`, not empty.
fn component(name: &str) -> io::Result<CString> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name:?} is not a file name"),
        ));
    }
    cstring(name.as_bytes())
}

/// `openat(dirfd, name, flags)`, the descriptor owned.
fn openat(dirfd: i32, name: &CString, flags: i32, mode: u32) -> io::Result<OwnedFd> {
    // SAFETY: `name` is a NUL-terminated string that outlives the call; the kernel only reads it.
    let fd = unsafe { libc::openat(dirfd, name.as_ptr(), flags | libc::O_CLOEXEC, mode) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by openat and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn fstat(fd: i32) -> io::Result<libc::stat> {
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid, writable `stat` the kernel fills; `fd` is open.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

fn facts(st: &libc::stat) -> FileFacts {
    FileFacts {
        owner: st.st_uid,
        bytes: st.st_size as u64,
        device: st.st_dev,
        inode: st.st_ino,
        modified: st.st_mtime,
    }
}

/// Why a file was refused: `Err` of [`Dir::open_file`].
#[derive(Debug)]
pub enum Refused {
    /// The lookup itself failed (no such name, a link where none may be, ...).
    Io(io::Error),
    /// It is there, but is not what the rules ask: says what it is instead.
    NotBelieved(String),
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::Io(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                write!(f, "a symbolic link where none may be: not followed")
            }
            Refused::Io(e) => write!(f, "{e}"),
            Refused::NotBelieved(why) => write!(f, "{why}: not believed"),
        }
    }
}

impl From<io::Error> for Refused {
    fn from(e: io::Error) -> Refused {
        Refused::Io(e)
    }
}

/// What a file type is, in words, for the refusals.
fn kind_of(mode: u32) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFREG => "a regular file",
        libc::S_IFDIR => "a directory",
        libc::S_IFLNK => "a symbolic link",
        libc::S_IFIFO => "a FIFO",
        libc::S_IFCHR => "a character device",
        libc::S_IFBLK => "a block device",
        libc::S_IFSOCK => "a socket",
        _ => "of an unknown type",
    }
}

/// Checks `st` against `rules`.
fn judge(st: &libc::stat, rules: &Rules) -> Result<(), Refused> {
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(Refused::NotBelieved(format!(
            "{}, not a regular file",
            kind_of(st.st_mode)
        )));
    }
    if st.st_uid != rules.owner {
        return Err(Refused::NotBelieved(format!(
            "owned by uid {}, not by the process's owner (uid {})",
            st.st_uid, rules.owner
        )));
    }
    if st.st_nlink != 1 {
        return Err(Refused::NotBelieved(format!(
            "{} names for one file (a hard link)",
            st.st_nlink
        )));
    }
    if st.st_size < 0 || st.st_size as u64 > rules.max_bytes {
        return Err(Refused::NotBelieved(format!(
            "{} bytes, more than a table's {}",
            st.st_size, rules.max_bytes
        )));
    }
    Ok(())
}

impl Dir {
    /// A directory of this host, by a path the caller chose (its own settings: `/dev/shm`, the
    /// lock directory), links in it followed as the caller's own path would be.
    pub fn open(path: &Path) -> io::Result<Dir> {
        let path = cstring(path.as_os_str().as_bytes())?;
        let fd = openat(libc::AT_FDCWD, &path, libc::O_PATH | libc::O_DIRECTORY, 0)?;
        Ok(Dir { fd })
    }

    /// The directory `inside` (absolute, as the process sees it) of the root `root` (a
    /// container's `/proc/<pid>/root`): resolved inside that root, no link followed — an
    /// absolute link planted in the container never reaches the host's files.
    pub fn open_in_root(root: &Path, inside: &Path) -> io::Result<Dir> {
        let root = Dir::open(root)?;
        let mut relative = Vec::new();
        for part in inside.components() {
            match part {
                Component::RootDir | Component::CurDir => {}
                Component::Normal(name) => relative.push(name),
                Component::ParentDir | Component::Prefix(_) => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("{}: `..` is not resolved here", inside.display()),
                    ))
                }
            }
        }
        if relative.is_empty() {
            return Ok(root);
        }
        let joined: Vec<u8> = relative
            .iter()
            .map(|n| n.as_bytes())
            .collect::<Vec<_>>()
            .join(&b'/');
        match openat2_in_root(&root, &cstring(&joined)?) {
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {}
            done => return done.map(|fd| Dir { fd }),
        }
        // No openat2 (a kernel before 5.6): one component at a time, none a link.
        let mut dir = root;
        for name in relative {
            let fd = openat(
                dir.fd.as_raw_fd(),
                &cstring(name.as_bytes())?,
                libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW,
                0,
            )?;
            dir = Dir { fd };
        }
        Ok(dir)
    }

    /// Whether `name` here is a directory (not a link to one).
    pub fn has_dir(&self, name: &str) -> bool {
        self.lstat(name)
            .is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR)
    }

    /// `fstatat(name, AT_SYMLINK_NOFOLLOW)`: what is at `name`, opening nothing.
    fn lstat(&self, name: &str) -> io::Result<libc::stat> {
        let name = component(name)?;
        // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `name` is NUL-terminated and `st` writable, both outlive the call; the
        // directory descriptor is open.
        let rc = unsafe {
            libc::fstatat(
                self.fd.as_raw_fd(),
                name.as_ptr(),
                &mut st,
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(st)
    }

    /// Whether anything is at `name` (a link included, not followed).
    pub fn has(&self, name: &str) -> bool {
        self.lstat(name).is_ok()
    }

    /// The owner of what is at `name` (not following a link): a cheap first look that opens
    /// nothing; [`Self::open_file`] checks again on the descriptor.
    pub fn owner_of(&self, name: &str) -> Option<u32> {
        self.lstat(name).ok().map(|st| st.st_uid)
    }

    /// The names in the directory (`.` and `..` left out; names that are not UTF-8 too: none of
    /// ours is).
    pub fn names(&self) -> io::Result<Vec<String>> {
        let listed = std::fs::read_dir(format!("/proc/self/fd/{}", self.fd.as_raw_fd()))?;
        Ok(listed
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .collect())
    }

    /// Opens `name` for reading when it is a regular file that `rules` allow, never following a
    /// link, never opening anything else (see the module's doc).
    pub fn open_file(&self, name: &str, rules: &Rules) -> Result<(File, FileFacts), Refused> {
        let name = component(name)?;
        let path_fd = openat(
            self.fd.as_raw_fd(),
            &name,
            libc::O_PATH | libc::O_NOFOLLOW,
            0,
        )?;
        let looked = fstat(path_fd.as_raw_fd())?;
        judge(&looked, rules)?;
        // The inode just judged, reopened for reading: /proc/self/fd names the descriptor's own
        // file, whatever the directory holds under `name` by now.
        let reopen = cstring(format!("/proc/self/fd/{}", path_fd.as_raw_fd()).as_bytes())?;
        let fd = openat(
            libc::AT_FDCWD,
            &reopen,
            libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY,
            0,
        )?;
        let opened = fstat(fd.as_raw_fd())?;
        if (opened.st_dev, opened.st_ino) != (looked.st_dev, looked.st_ino) {
            return Err(Refused::NotBelieved("changed while opened".into()));
        }
        judge(&opened, rules)?;
        Ok((File::from(fd), facts(&opened)))
    }

    /// Creates `name` for reading and writing, only if nothing is there (`O_EXCL`, which never
    /// follows a link either), with `mode`.
    pub fn create_new(&self, name: &str, mode: u32) -> io::Result<File> {
        let name = component(name)?;
        let fd = openat(
            self.fd.as_raw_fd(),
            &name,
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_NONBLOCK,
            mode,
        )?;
        Ok(File::from(fd))
    }

    /// The first `limit` names of the directory (as [`Self::names`]), in the order the kernel
    /// lists them: what a bounded sweep may look at, whatever else another user put there.
    pub fn names_at_most(&self, limit: usize) -> io::Result<Vec<String>> {
        let listed = std::fs::read_dir(format!("/proc/self/fd/{}", self.fd.as_raw_fd()))?;
        Ok(listed
            .take(limit)
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .collect())
    }

    /// The filesystem the directory is on: its free bytes for an unprivileged writer, and whether
    /// it is mounted read-only (`fstatvfs` on the descriptor), for saying why a table is missing.
    pub fn space(&self) -> io::Result<Space> {
        // SAFETY: an all-zero `statvfs` is a valid value of this plain C struct.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: `st` is a valid, writable `statvfs` the kernel fills; the descriptor is open.
        if unsafe { libc::fstatvfs(self.fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Space {
            free_bytes: st.f_bavail as u64 * st.f_frsize as u64,
            total_bytes: st.f_blocks as u64 * st.f_frsize as u64,
            read_only: st.f_flag & libc::ST_RDONLY != 0,
        })
    }

    /// Renames `from` to `to`, both in this directory: what was at `to` (a file, or a link
    /// itself, never followed) is replaced in one step.
    pub fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        let (from, to) = (component(from)?, component(to)?);
        let fd = self.fd.as_raw_fd();
        // SAFETY: both names are NUL-terminated and outlive the call; the directory is open.
        if unsafe { libc::renameat(fd, from.as_ptr(), fd, to.as_ptr()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Flushes the directory itself to disk (its entries: a rename in it survives a crash).
    pub fn sync(&self) -> io::Result<()> {
        // An O_PATH descriptor cannot be synced: the directory itself, opened for reading.
        let itself = openat(
            self.fd.as_raw_fd(),
            &cstring(b".")?,
            libc::O_RDONLY | libc::O_DIRECTORY,
            0,
        )?;
        File::from(itself).sync_all()
    }

    /// The directory's device and inode: two `Dir`s with the same are one directory.
    pub fn identity(&self) -> io::Result<(u64, u64)> {
        let st = fstat(self.fd.as_raw_fd())?;
        Ok((st.st_dev, st.st_ino))
    }

    /// Removes `name` (a file, or a link itself), whatever it is.
    pub fn remove(&self, name: &str) -> io::Result<()> {
        let name = component(name)?;
        // SAFETY: `name` is NUL-terminated and outlives the call; the directory is open.
        if unsafe { libc::unlinkat(self.fd.as_raw_fd(), name.as_ptr(), 0) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// A directory's filesystem as [`Dir::space`] tells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Space {
    pub free_bytes: u64,
    pub total_bytes: u64,
    pub read_only: bool,
}

/// A file this process created, found again by its path for a moment's work (the thread table's
/// pages, allocated as it grows), so that no descriptor stays open in the host program, where a
/// `close_range` or a reused number could turn it into someone else's file. Reopened without
/// following a link, and used only when the descriptor is the very inode created (device and
/// inode checked on it): a name removed or replaced meanwhile is never written.
pub struct OwnFile {
    path: CString,
    device: u64,
    inode: u64,
}

impl OwnFile {
    /// `file`, just created at `path`.
    pub fn remember(path: &Path, file: &File) -> io::Result<OwnFile> {
        let st = fstat(file.as_raw_fd())?;
        Ok(OwnFile {
            path: cstring(path.as_os_str().as_bytes())?,
            device: st.st_dev,
            inode: st.st_ino,
        })
    }

    /// Allocates the bytes `offset..offset + len` of the file (`fallocate`, its size kept), so
    /// that a store into a shared mapping of them can no longer fault for want of a page: a full
    /// or read-only filesystem answers here with an errno, never later with SIGBUS.
    pub fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        let fd = openat(
            libc::AT_FDCWD,
            &self.path,
            libc::O_WRONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK,
            0,
        )?;
        let st = fstat(fd.as_raw_fd())?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG
            || st.st_dev != self.device
            || st.st_ino != self.inode
        {
            return Err(io::Error::from_raw_os_error(libc::ESTALE));
        }
        let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        };
        // SAFETY: a plain system call on a descriptor this function owns; no memory is passed.
        let rc = unsafe { libc::fallocate(fd.as_raw_fd(), libc::FALLOC_FL_KEEP_SIZE, offset, len) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// `openat2(root, path, O_PATH | O_DIRECTORY, RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS |
/// RESOLVE_NO_MAGICLINKS)`: `ENOSYS` on a kernel without it.
fn openat2_in_root(root: &Dir, path: &CString) -> io::Result<OwnedFd> {
    /// `struct open_how` of linux/openat2.h (libc's is non-exhaustive: not constructible).
    #[repr(C)]
    struct OpenHow {
        flags: u64,
        mode: u64,
        resolve: u64,
    }
    let how = OpenHow {
        flags: (libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) as u64,
        mode: 0,
        resolve: libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS,
    };
    // SAFETY: `path` is NUL-terminated and `how` a valid open_how of the size passed; both
    // outlive the call, and the kernel only reads them.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            root.fd.as_raw_fd(),
            path.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by openat2 and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// 64 bits nobody can predict (`getrandom`), for a name nobody could have planted; `None`
/// when the kernel has none to give yet (early at boot: `GRND_NONBLOCK`, never a wait in the
/// host program's thread creation).
pub fn unpredictable() -> Option<u64> {
    let mut bytes = [0u8; 8];
    // SAFETY: the kernel writes at most 8 bytes into `bytes`, which is 8 bytes long.
    let got =
        unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), libc::GRND_NONBLOCK) };
    (got == 8).then(|| u64::from_le_bytes(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn me() -> u32 {
        crate::sys::effective_uid()
    }

    fn rules() -> Rules {
        Rules {
            owner: me(),
            max_bytes: 1 << 20,
        }
    }

    #[test]
    fn a_regular_file_of_the_owner_opens_and_nothing_else_does() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = Dir::open(tmp.path()).unwrap();
        std::fs::write(tmp.path().join("table"), b"hello").unwrap();
        let (file, facts) = dir.open_file("table", &rules()).unwrap();
        assert_eq!(facts.bytes, 5);
        assert_eq!(std::io::read_to_string(file).unwrap(), "hello");

        std::os::unix::fs::symlink(tmp.path().join("table"), tmp.path().join("link")).unwrap();
        let refused = dir.open_file("link", &rules()).unwrap_err().to_string();
        assert!(refused.contains("symbolic link"), "{refused}");

        std::fs::hard_link(tmp.path().join("table"), tmp.path().join("second")).unwrap();
        let refused = dir.open_file("second", &rules()).unwrap_err().to_string();
        assert!(refused.contains("hard link"), "{refused}");
        std::fs::remove_file(tmp.path().join("second")).unwrap();

        let fifo = cstring(tmp.path().join("fifo").as_os_str().as_bytes()).unwrap();
        // SAFETY: a NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let refused = dir.open_file("fifo", &rules()).unwrap_err().to_string();
        assert!(refused.contains("FIFO"), "{refused}");

        std::fs::create_dir(tmp.path().join("sub")).unwrap();
        assert!(dir.open_file("sub", &rules()).is_err());
        assert!(dir.open_file("../etc", &rules()).is_err());

        let big = std::fs::File::create(tmp.path().join("big")).unwrap();
        big.set_len(2 << 20).unwrap();
        let refused = dir.open_file("big", &rules()).unwrap_err().to_string();
        assert!(refused.contains("bytes"), "{refused}");

        let other = Rules {
            owner: me().wrapping_add(1),
            ..rules()
        };
        let refused = dir.open_file("table", &other).unwrap_err().to_string();
        assert!(refused.contains("owned by uid"), "{refused}");
    }

    #[test]
    fn inside_a_root_an_absolute_link_is_never_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        std::fs::create_dir_all(root.join("dev/shm")).unwrap();
        std::fs::create_dir_all(root.join("real")).unwrap();
        std::os::unix::fs::symlink("/tmp", root.join("dev/link")).unwrap();
        let shm = Dir::open_in_root(root, Path::new("/dev/shm")).unwrap();
        std::fs::write(root.join("dev/shm/x"), b"x").unwrap();
        assert!(shm.open_file("x", &rules()).is_ok());
        assert!(Dir::open_in_root(root, Path::new("/dev/link")).is_err());
        assert!(Dir::open_in_root(root, Path::new("/dev/../etc")).is_err());
    }

    #[test]
    fn create_new_never_takes_an_existing_name() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = Dir::open(tmp.path()).unwrap();
        let file = dir.create_new("t", 0o644).unwrap();
        assert_eq!(file.metadata().unwrap().uid(), me());
        assert!(dir.create_new("t", 0o644).is_err());
        std::os::unix::fs::symlink("/nonexistent", tmp.path().join("l")).unwrap();
        assert!(dir.create_new("l", 0o644).is_err());
        assert!(!Path::new("/nonexistent").exists());
        // A rename replaces a link at the new name, never writing where it points.
        std::fs::write(tmp.path().join("target"), b"kept").unwrap();
        std::os::unix::fs::symlink(tmp.path().join("target"), tmp.path().join("final")).unwrap();
        dir.rename("t", "final").unwrap();
        assert!(std::fs::symlink_metadata(tmp.path().join("final"))
            .unwrap()
            .file_type()
            .is_file());
        assert_eq!(std::fs::read(tmp.path().join("target")).unwrap(), b"kept");
        dir.sync().unwrap();
        assert_eq!(
            dir.identity().unwrap(),
            Dir::open(tmp.path()).unwrap().identity().unwrap()
        );
        dir.remove("final").unwrap();
        assert!(!dir.has("final"));
        assert_ne!(unpredictable(), unpredictable());
    }
}
