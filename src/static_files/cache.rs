//! Layer: static files. The open-file and content cache of one static tree
//! (nginx's `open_file_cache`, plus the content): what a (lane, URL path)
//! resolved to — a file with its validators, headers rendered once and, up
//! to a bounded total, its content as `Bytes`; a directory; or nothing. A hit
//! is a lock of one of 16 shards, a hash lookup and a reference-count clone:
//! no syscall, no allocation. An entry older than `valid_ms` is checked
//! against the disk again (`stat` on the worker thread, page-cached) by the
//! one request that claims it, so a file replaced or deleted on disk is seen
//! within `valid_ms` plus a request.

use std::cell::RefCell;
use std::fs::File;
use std::io::{self, Read};
use std::num::NonZeroUsize;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, UNIX_EPOCH};

use bytes::Bytes;
use http::HeaderValue;
use lru::LruCache;
use rustc_hash::FxBuildHasher;

use crate::base::clock::now_ms;
use crate::config::{SizeValue, StaticCacheConfig, FORMAL};

/// Shards of the entry map (a power of two).
const SHARDS: usize = 16;

/// Limits of one tree's cache (`static_cache` in the main config).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CacheSettings {
    /// Content bytes the cache may hold.
    pub max_size: usize,
    /// Larger files are never held (read in chunks per request).
    pub max_file_size: usize,
    /// Entries (files, directories, misses).
    pub max_entries: usize,
    /// Age after which an entry is checked against the disk.
    pub valid_ms: u64,
}

impl Default for CacheSettings {
    /// `static_cache`'s defaults.
    fn default() -> Self {
        let c = StaticCacheConfig::default();
        let bytes = |v: &SizeValue| v.bytes().expect("the default sizes are byte counts");
        CacheSettings {
            max_size: bytes(&c.max_size),
            max_file_size: bytes(&c.max_file_size),
            max_entries: c.max_entries,
            valid_ms: c.valid_ms,
        }
    }
}

/// What identifies one version of a file on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileId {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: i64,
    mtime_ns: i64,
}

impl FileId {
    pub fn of(m: &std::fs::Metadata) -> FileId {
        FileId {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            mtime: m.mtime(),
            mtime_ns: m.mtime_nsec(),
        }
    }
}

/// The body of a cached file.
#[derive(Debug)]
pub enum Content {
    /// Held in memory.
    Mem(Bytes),
    /// Too large (or over the budget): opened and read per request.
    Disk,
}

/// A file as served: validators and headers rendered once.
#[derive(Debug)]
pub struct FileInfo {
    pub path: PathBuf,
    pub id: FileId,
    pub size: u64,
    /// The lane whose tree holds the file, and `static:<lane>`.
    pub served_lane: Arc<str>,
    pub node: Arc<str>,
    pub etag: HeaderValue,
    pub last_modified: Option<HeaderValue>,
    /// Whole seconds of the modification time, when it is a real one.
    pub modified_secs: Option<u64>,
    pub content_type: Option<HeaderValue>,
    pub content_length: HeaderValue,
    pub content: Content,
    /// The file kept open for `sendfile`, when its content is held and it is
    /// large enough to be sent that way (see [`HeldFile`]).
    pub open: Option<HeldFile>,
}

/// A descriptor a cache entry keeps open (nginx's `open_file_cache`): a
/// whole-file answer sends from it by `sendfile` without an `open` and a
/// `close` per request, after an `fstat` that it is still the cached version.
/// Only files whose content the entry holds get one, so what a held
/// descriptor can pin of a file deleted meanwhile (until the entry is
/// checked again or evicted) is bounded by `static_cache.max_size`; and at
/// most [`FileCache::open_limit`] per tree.
#[derive(Debug)]
pub struct HeldFile {
    pub file: Arc<File>,
    count: Arc<AtomicUsize>,
}

impl Drop for HeldFile {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a (lane, URL path) resolved to. (Not boxed: it lives in the
/// entry's `Arc` already; a box would be one more pointer chase per hit.)
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Resolved {
    File(FileInfo),
    /// A directory requested without its trailing slash.
    Directory,
    NotFound,
    /// The file is there but could not be opened (out of descriptors, an
    /// I/O error): never cached, the next request tries again.
    Unavailable(Arc<io::Error>),
}

#[derive(Debug)]
pub struct Entry {
    checked_ms: AtomicU64,
    pub resolved: Resolved,
}

impl Entry {
    fn charge(&self) -> usize {
        match &self.resolved {
            Resolved::File(FileInfo {
                content: Content::Mem(b),
                ..
            }) => b.len(),
            _ => 0,
        }
    }
}

type Shard = Mutex<LruCache<Box<str>, Arc<Entry>, FxBuildHasher>>;

/// One static tree's cache.
pub struct FileCache {
    pub settings: CacheSettings,
    shards: Box<[Shard]>,
    /// Content bytes held by entries in the map.
    held: AtomicUsize,
    /// Descriptors held ([`HeldFile`]), and how many may be.
    open_files: Arc<AtomicUsize>,
    open_limit: usize,
}

impl std::fmt::Debug for FileCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileCache")
            .field("settings", &self.settings)
            .field("held", &self.held.load(Ordering::Relaxed))
            .field("open_files", &self.open_files())
            .finish()
    }
}

thread_local! {
    /// The key being looked up (`lane \n path`), reused: no allocation.
    static KEY: RefCell<String> = const { RefCell::new(String::new()) };
}

/// The cache of a tree (root + index), shared by every generation that
/// serves it so a reload keeps what is cached; a new one when the settings
/// change. Dropped with the last generation naming the tree.
pub fn cache_for(root: &Path, index: &str, settings: CacheSettings) -> Arc<FileCache> {
    type Key = (PathBuf, String, CacheSettings);
    type Registry = Mutex<Vec<(Key, Weak<FileCache>)>>;
    static REG: OnceLock<Registry> = OnceLock::new();
    let mut reg = REG
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    reg.retain(|(_, w)| w.strong_count() > 0);
    let key = (root.to_path_buf(), index.to_string(), settings);
    if let Some(c) = reg
        .iter()
        .find(|(k, _)| *k == key)
        .and_then(|(_, w)| w.upgrade())
    {
        return c;
    }
    let c = Arc::new(FileCache::new(settings));
    reg.push((key, Arc::downgrade(&c)));
    c
}

impl FileCache {
    pub fn new(settings: CacheSettings) -> FileCache {
        let per_shard =
            NonZeroUsize::new(settings.max_entries.div_ceil(SHARDS).max(1)).expect("at least one");
        FileCache {
            settings,
            shards: (0..SHARDS)
                .map(|_| Mutex::new(LruCache::with_hasher(per_shard, FxBuildHasher)))
                .collect(),
            held: AtomicUsize::new(0),
            open_files: Arc::default(),
            open_limit: open_limit(settings.max_entries),
        }
    }

    /// Descriptors held by entries now ([`HeldFile`]).
    pub fn open_files(&self) -> usize {
        self.open_files.load(Ordering::Relaxed)
    }

    /// The most descriptors this tree's entries may hold.
    pub fn open_limit(&self) -> usize {
        self.open_limit
    }

    /// Keeps `file` open for its entry, if the tree's limit allows.
    fn hold(&self, file: File) -> Option<HeldFile> {
        if self.open_files.fetch_add(1, Ordering::Relaxed) >= self.open_limit {
            self.open_files.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(HeldFile {
            file: Arc::new(file),
            count: self.open_files.clone(),
        })
    }

    /// Content bytes held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    fn shard(&self, key: &str) -> &Shard {
        use std::hash::BuildHasher;
        let h = FxBuildHasher.hash_one(key);
        &self.shards[(h >> 32) as usize & (SHARDS - 1)]
    }

    /// The entry for `url_path` in `lane`, from the cache when it is there
    /// and fresh, else resolved with `resolve` (given the URL path) and
    /// cached.
    pub fn get(
        &self,
        root: &Path,
        lane: &str,
        url_path: &str,
        resolve: impl Fn(&str) -> Option<PathBuf>,
    ) -> Arc<Entry> {
        self.get_variant(root, lane, url_path, "", resolve)
    }

    /// [`FileCache::get`] for a `variant` of the URL path's file (a
    /// precompressed sibling's suffix; `""`: the file itself), cached
    /// under its own key.
    pub fn get_variant(
        &self,
        root: &Path,
        lane: &str,
        url_path: &str,
        variant: &str,
        resolve: impl Fn(&str) -> Option<PathBuf>,
    ) -> Arc<Entry> {
        KEY.with_borrow_mut(|key| {
            fill_key(key, lane, url_path, variant);
            let shard = self.shard(key);
            let hit = shard
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(key.as_str())
                .cloned();
            let now = now_ms();
            if let Some(e) = hit {
                let checked = e.checked_ms.load(Ordering::Relaxed);
                if now.saturating_sub(checked) < self.settings.valid_ms
                    || e.checked_ms
                        .compare_exchange(checked, now, Ordering::Relaxed, Ordering::Relaxed)
                        .is_err()
                {
                    // Fresh, or another request is checking it right now.
                    return e;
                }
                let found = resolve(url_path).map(|rel| find(root, lane, &rel));
                if still_same(&e.resolved, found.as_ref()) {
                    return e;
                }
                return self.insert(shard, key, lane, now, found);
            }
            let found = resolve(url_path).map(|rel| find(root, lane, &rel));
            self.insert(shard, key, lane, now, found)
        })
    }

    /// Drops the entry for (lane, URL path), e.g. when the file opened for it
    /// is not the one cached.
    pub fn forget(&self, lane: &str, url_path: &str) {
        self.forget_variant(lane, url_path, "")
    }

    /// [`FileCache::forget`] for a variant ([`FileCache::get_variant`]).
    pub fn forget_variant(&self, lane: &str, url_path: &str, variant: &str) {
        let mut key = String::new();
        fill_key(&mut key, lane, url_path, variant);
        let gone = self
            .shard(&key)
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop(key.as_str());
        if let Some(e) = gone {
            self.held.fetch_sub(e.charge(), Ordering::Relaxed);
        }
    }

    fn insert(
        &self,
        shard: &Shard,
        key: &str,
        lane: &str,
        now: u64,
        found: Option<Found>,
    ) -> Arc<Entry> {
        let resolved = match found {
            None | Some(Found::NotFound) => Resolved::NotFound,
            Some(Found::Directory) => Resolved::Directory,
            Some(Found::File { path, own, .. }) => {
                match self.load(path, if own { lane } else { FORMAL }) {
                    Ok(info) => Resolved::File(info),
                    Err(OpenError::Gone) => Resolved::NotFound,
                    Err(OpenError::Failed(e)) => {
                        // Not remembered: the failure is the gateway's
                        // state, not the file's (an entry kept as missing
                        // would answer 404 after the gateway recovered).
                        let old = shard.lock().unwrap_or_else(|p| p.into_inner()).pop(key);
                        if let Some(old) = old {
                            self.held.fetch_sub(old.charge(), Ordering::Relaxed);
                        }
                        return Arc::new(Entry {
                            checked_ms: AtomicU64::new(now),
                            resolved: Resolved::Unavailable(Arc::new(e)),
                        });
                    }
                }
            }
        };
        let e = Arc::new(Entry {
            checked_ms: AtomicU64::new(now),
            resolved,
        });
        let old = shard
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(key.into(), e.clone());
        if let Some((_, old)) = old {
            self.held.fetch_sub(old.charge(), Ordering::Relaxed);
        }
        e
    }

    /// Reserves `n` content bytes, evicting least-recently-used entries
    /// (starting with `from`'s shard) while the budget is short.
    fn reserve(&self, n: usize, from: usize) -> bool {
        if n > self.settings.max_file_size {
            return false;
        }
        let mut evictions = 0;
        loop {
            let cur = self.held.load(Ordering::Relaxed);
            if cur + n <= self.settings.max_size {
                if self
                    .held
                    .compare_exchange(cur, cur + n, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
                {
                    return true;
                }
                continue;
            }
            if evictions >= 4 * SHARDS {
                return false;
            }
            let shard = &self.shards[(from + evictions) % SHARDS];
            let popped = shard.lock().unwrap_or_else(|p| p.into_inner()).pop_lru();
            if let Some((_, e)) = popped {
                self.held.fetch_sub(e.charge(), Ordering::Relaxed);
            }
            evictions += 1;
        }
    }

    /// Opens the file and renders what its responses carry; its content is
    /// read when it fits the limits. [`OpenError::Gone`] when it vanished
    /// meanwhile.
    fn load(&self, path: PathBuf, lane: &str) -> Result<FileInfo, OpenError> {
        let (mut file, meta) = open_regular(&path)?;
        let size = meta.len();
        let content = match usize::try_from(size) {
            Ok(n) if self.reserve(n, fastrand::usize(..SHARDS)) => {
                let mut buf = Vec::with_capacity(n);
                match file.read_to_end(&mut buf) {
                    Ok(got) if got == n => Content::Mem(Bytes::from(buf)),
                    _ => {
                        // Changed while read: serve it from disk (and the
                        // next check sees the new version).
                        self.held.fetch_sub(n, Ordering::Relaxed);
                        Content::Disk
                    }
                }
            }
            _ => Content::Disk,
        };
        let open = match content {
            Content::Mem(_) if size >= super::SENDFILE_MIN => self.hold(file),
            _ => None,
        };
        Ok(render(path, lane, &meta, content, open))
    }
}

/// Headers and validators of a file, rendered once.
fn render(
    path: PathBuf,
    lane: &str,
    meta: &std::fs::Metadata,
    content: Content,
    open: Option<HeldFile>,
) -> FileInfo {
    let size = meta.len();
    let modified = meta.modified().ok();
    let since_epoch = modified.and_then(|m| m.duration_since(UNIX_EPOCH).ok());
    // Zero and near-zero mtimes are not real ones (hyper-staticfile's rule).
    let real = since_epoch.filter(|d| *d >= Duration::from_secs(2));
    let etag = super::etag_for(lane, size, modified);
    let content_type = mime_guess::from_path(&path).first().map(|m| {
        let s = match m.type_() {
            mime_guess::mime::TEXT => format!("{m}; charset=utf-8"),
            _ if m.subtype() == mime_guess::mime::JAVASCRIPT => format!("{m}; charset=utf-8"),
            _ => m.to_string(),
        };
        HeaderValue::from_str(&s).expect("a MIME type is a valid header value")
    });
    FileInfo {
        id: FileId::of(meta),
        size,
        served_lane: lane.into(),
        node: format!("static:{lane}").into(),
        etag: HeaderValue::from_str(&etag).expect("etag is ASCII"),
        last_modified: real.map(|d| {
            HeaderValue::from_str(&httpdate::fmt_http_date(UNIX_EPOCH + d))
                .expect("an HTTP date is ASCII")
        }),
        modified_secs: real.map(|d| d.as_secs()),
        content_type,
        content_length: HeaderValue::from(size),
        content,
        open,
        path,
    }
}

/// Descriptors one tree's entries may hold: a quarter of the process's
/// descriptor limit (the rest is for connections), at most one per entry.
fn open_limit(max_entries: usize) -> usize {
    let soft = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    max_entries.min(usize::try_from(soft / 4).unwrap_or(usize::MAX))
}

/// Where a relative path leads in a lane's tree (else formal's).
pub enum Found {
    File {
        path: PathBuf,
        /// In the lane's own tree (else formal's).
        own: bool,
        id: FileId,
    },
    Directory,
    NotFound,
}

/// The cache key of (lane, URL path, variant): `lane \n path`, then NUL
/// (never in a URL path) and the variant when there is one.
fn fill_key(key: &mut String, lane: &str, url_path: &str, variant: &str) {
    key.clear();
    key.push_str(lane);
    key.push('\n');
    key.push_str(url_path);
    if !variant.is_empty() {
        key.push('\0');
        key.push_str(variant);
    }
}

/// Why a file could not be opened.
#[derive(Debug)]
pub enum OpenError {
    /// Missing, not readable by the gateway, or not a regular file: the
    /// file's own state (404).
    Gone,
    /// Anything else — out of descriptors (`EMFILE`, `ENFILE`), an I/O
    /// error: the gateway's state (503), tried again by the next request.
    Failed(io::Error),
}

impl From<io::Error> for OpenError {
    fn from(e: io::Error) -> OpenError {
        use io::ErrorKind as K;
        match e.kind() {
            K::NotFound | K::PermissionDenied | K::IsADirectory | K::NotADirectory => {
                OpenError::Gone
            }
            _ => OpenError::Failed(e),
        }
    }
}

/// Opens `path` if it is a regular file (with its metadata). `O_NONBLOCK`:
/// a FIFO or device put where a file was is refused at once, never waited
/// on by the worker thread (for a regular file the flag changes nothing).
pub fn open_regular(path: &Path) -> Result<(File, std::fs::Metadata), OpenError> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(OpenError::Gone);
    }
    Ok((file, meta))
}

/// Finds `rel` in the lane's tree, else formal's; symlinks leading out of
/// the tree are treated as missing. A few `stat` calls, as nginx does
/// inline.
pub fn find(root: &Path, lane: &str, rel: &Path) -> Found {
    let mut saw_dir = false;
    for (i, l) in [lane, FORMAL].into_iter().enumerate() {
        if i == 1 && lane == FORMAL {
            break;
        }
        let candidate = root.join(l).join(rel);
        let Ok(canon) = candidate.canonicalize() else {
            continue;
        };
        if !canon.starts_with(root) {
            continue;
        }
        match std::fs::metadata(&canon) {
            Ok(m) if m.is_file() => {
                return Found::File {
                    path: canon,
                    own: i == 0,
                    id: FileId::of(&m),
                }
            }
            Ok(m) if m.is_dir() => saw_dir = true,
            _ => {}
        }
    }
    if saw_dir {
        Found::Directory
    } else {
        Found::NotFound
    }
}

/// Whether a fresh resolution leads to what the entry holds.
fn still_same(old: &Resolved, found: Option<&Found>) -> bool {
    match (old, found) {
        (Resolved::NotFound, None | Some(Found::NotFound)) => true,
        (Resolved::Directory, Some(Found::Directory)) => true,
        (Resolved::File(f), Some(Found::File { path, id, .. })) => f.path == *path && f.id == *id,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(files: &[(&str, usize)]) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join(FORMAL)).unwrap();
        for (name, n) in files {
            std::fs::write(d.path().join(FORMAL).join(name), vec![b'x'; *n]).unwrap();
        }
        d
    }

    fn rel(p: &str) -> Option<PathBuf> {
        Some(PathBuf::from(p.trim_start_matches('/')))
    }

    fn in_memory(e: &Entry) -> Option<usize> {
        match &e.resolved {
            Resolved::File(f) => match &f.content {
                Content::Mem(b) => Some(b.len()),
                Content::Disk => None,
            },
            _ => panic!("not a file"),
        }
    }

    #[test]
    fn content_held_never_exceeds_max_size_and_big_files_stay_on_disk() {
        let names: Vec<String> = (0..40).map(|i| format!("f{i}.bin")).collect();
        let mut files: Vec<(&str, usize)> = names.iter().map(|n| (n.as_str(), 3000)).collect();
        files.push(("big.bin", 5000));
        let d = tree(&files);
        let root = d.path().canonicalize().unwrap();
        let c = FileCache::new(CacheSettings {
            max_size: 10_000,
            max_file_size: 4096,
            max_entries: 1000,
            valid_ms: 60_000,
        });
        for round in 0..3 {
            for n in &names {
                let e = c.get(&root, FORMAL, &format!("/{n}"), rel);
                assert!(c.held() <= 10_000, "round {round}: {} held", c.held());
                // Evicting others makes room: every small file fits.
                assert_eq!(in_memory(&e), Some(3000));
            }
        }
        let e = c.get(&root, FORMAL, "/big.bin", rel);
        assert_eq!(in_memory(&e), None, "over max_file_size");
        assert!(c.held() <= 10_000);
        // The map holds what it charged: forgetting every entry frees all.
        for n in names.iter().map(String::as_str).chain(["big.bin"]) {
            c.forget(FORMAL, &format!("/{n}"));
        }
        assert_eq!(c.held(), 0);
    }

    #[test]
    fn entries_are_bounded_and_a_hit_is_the_same_entry() {
        let d = tree(&[("a.txt", 10)]);
        let root = d.path().canonicalize().unwrap();
        let c = FileCache::new(CacheSettings {
            max_entries: 32,
            valid_ms: 60_000,
            ..CacheSettings::default()
        });
        let a = c.get(&root, FORMAL, "/a.txt", rel);
        let again = c.get(&root, FORMAL, "/a.txt", |_| {
            panic!("a hit resolves nothing")
        });
        assert!(Arc::ptr_eq(&a, &again));
        // Misses are entries too, and the map stays within max_entries.
        for i in 0..1000 {
            c.get(&root, FORMAL, &format!("/missing{i}"), rel);
        }
        let n: usize = c.shards.iter().map(|s| s.lock().unwrap().len()).sum();
        assert!(n <= 32, "{n} entries");
        // Another lane's entry for the same path is its own.
        let g = c.get(&root, "gray", "/a.txt", rel);
        assert!(!Arc::ptr_eq(&a, &g));
    }

    fn held_file(e: &Entry) -> Option<&Arc<File>> {
        match &e.resolved {
            Resolved::File(f) => f.open.as_ref().map(|h| &h.file),
            _ => panic!("not a file"),
        }
    }

    /// Only a file's own state is a miss: out of descriptors (or any
    /// other failure) is the gateway's, and never cached.
    #[test]
    fn open_errors_other_than_absence_are_not_misses() {
        let dir = tree(&[("f.txt", 3)]);
        let gone =
            |r: Result<(File, std::fs::Metadata), OpenError>| matches!(r, Err(OpenError::Gone));
        assert!(gone(open_regular(&dir.path().join("formal/none"))));
        assert!(gone(open_regular(&dir.path().join("formal/f.txt/x"))));
        assert!(gone(open_regular(&dir.path().join("formal"))));
        assert!(open_regular(&dir.path().join("formal/f.txt")).is_ok());
        for errno in [
            rustix::io::Errno::MFILE,
            rustix::io::Errno::NFILE,
            rustix::io::Errno::IO,
        ] {
            let e = io::Error::from_raw_os_error(errno.raw_os_error());
            assert!(
                matches!(OpenError::from(e), OpenError::Failed(_)),
                "{errno:?}"
            );
        }
        for errno in [
            rustix::io::Errno::NOENT,
            rustix::io::Errno::ACCESS,
            rustix::io::Errno::ISDIR,
        ] {
            let e = io::Error::from_raw_os_error(errno.raw_os_error());
            assert!(matches!(OpenError::from(e), OpenError::Gone), "{errno:?}");
        }
    }

    /// Descriptors are kept only for held content large enough for
    /// `sendfile`, never beyond the tree's limit, and given back with their
    /// entries.
    #[test]
    fn descriptors_are_kept_for_big_held_files_only_and_within_the_limit() {
        let big = super::super::SENDFILE_MIN as usize;
        let names: Vec<String> = (0..6).map(|i| format!("b{i}.bin")).collect();
        let mut files: Vec<(&str, usize)> = names.iter().map(|n| (n.as_str(), big)).collect();
        files.extend([("small.txt", 100), ("huge.bin", 3 * big)]);
        let d = tree(&files);
        let root = d.path().canonicalize().unwrap();
        let mut c = FileCache::new(CacheSettings {
            max_size: 1 << 30,
            max_file_size: 2 * big,
            max_entries: 1000,
            valid_ms: 60_000,
        });
        assert!(c.open_limit() >= 16, "limit {}", c.open_limit());
        c.open_limit = 4;
        let small = c.get(&root, FORMAL, "/small.txt", rel);
        assert!(held_file(&small).is_none(), "small files are written");
        let huge = c.get(&root, FORMAL, "/huge.bin", rel);
        assert_eq!(in_memory(&huge), None);
        assert!(
            held_file(&huge).is_none(),
            "content not held: opened per answer"
        );
        let entries: Vec<_> = names
            .iter()
            .map(|n| c.get(&root, FORMAL, &format!("/{n}"), rel))
            .collect();
        let kept = entries.iter().filter(|e| held_file(e).is_some()).count();
        assert_eq!((kept, c.open_files()), (4, 4), "the limit");
        // A hit is the same descriptor.
        let again = c.get(&root, FORMAL, "/b0.bin", |_| panic!("a hit"));
        assert!(Arc::ptr_eq(
            held_file(&again).unwrap(),
            held_file(&entries[0]).unwrap()
        ));
        drop((again, entries));
        for n in &names {
            c.forget(FORMAL, &format!("/{n}"));
        }
        assert_eq!(c.open_files(), 0, "given back with the entries");
        // Room again: the next big file gets one.
        let e = c.get(&root, FORMAL, "/b5.bin", rel);
        assert!(held_file(&e).is_some());
        assert_eq!(c.open_files(), 1);
    }
}
