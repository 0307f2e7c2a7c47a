//! Layer: lane. `ngx.shared.<dict>`: process-wide key/value dictionaries
//! declared in the config, shared by every worker thread's Lua VM and surviving
//! reloads (they live in a registry outside the `Generation`, keyed by name).
//! Each dictionary is bounded in bytes; when full, `set` evicts the least
//! recently used items, as OpenResty's `lua_shared_dict` does. A generation
//! being built gets build-private dictionaries ([`pending`]); only a committed
//! one is given the live dictionaries ([`adopt`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use lru::LruCache;

/// Bookkeeping bytes charged per item on top of key and value.
const ITEM_OVERHEAD: usize = 64;
/// Longest key accepted (OpenResty's limit).
pub const MAX_KEY_LEN: usize = 65_535;

/// A stored value.
#[derive(Debug, Clone, PartialEq)]
pub enum DictValue {
    Int(i64),
    Num(f64),
    Bool(bool),
    Str(Vec<u8>),
}

impl DictValue {
    fn size(&self) -> usize {
        match self {
            DictValue::Str(s) => s.len(),
            _ => 8,
        }
    }
}

#[derive(Debug)]
struct Entry {
    value: DictValue,
    expires: Option<Instant>,
}

impl Entry {
    fn live(&self, now: Instant) -> bool {
        self.expires.is_none_or(|t| t > now)
    }
}

#[derive(Debug)]
struct Inner {
    items: LruCache<Vec<u8>, Entry>,
    used: usize,
    capacity: usize,
}

/// Why a write failed (the second return value in Lua).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DictError {
    Exists,
    NotFound,
    NotANumber,
    NoMemory,
}

impl DictError {
    pub fn as_str(self) -> &'static str {
        match self {
            DictError::Exists => "exists",
            DictError::NotFound => "not found",
            DictError::NotANumber => "not a number",
            DictError::NoMemory => "no memory",
        }
    }
}

/// One shared dictionary.
#[derive(Debug)]
pub struct SharedDict {
    pub name: String,
    inner: Mutex<Inner>,
}

fn item_size(key: &[u8], v: &DictValue) -> usize {
    key.len() + v.size() + ITEM_OVERHEAD
}

fn expiry(ttl: Option<f64>) -> Option<Instant> {
    ttl.filter(|t| *t > 0.0)
        .map(|t| Instant::now() + Duration::from_secs_f64(t.min(1e9)))
}

impl SharedDict {
    pub fn new(name: &str, capacity: usize) -> SharedDict {
        SharedDict {
            name: name.to_string(),
            inner: Mutex::new(Inner {
                items: LruCache::unbounded(),
                used: 0,
                capacity,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn capacity(&self) -> usize {
        self.lock().capacity
    }

    /// Bytes currently charged.
    pub fn used(&self) -> usize {
        self.lock().used
    }

    /// Changes the byte bound, evicting least recently used items if the
    /// dictionary shrank.
    pub fn set_capacity(&self, capacity: usize) {
        let mut g = self.lock();
        g.capacity = capacity;
        g.evict_until_fits(0);
    }

    /// The live value of `key`.
    pub fn get(&self, key: &[u8]) -> Option<DictValue> {
        let mut g = self.lock();
        let now = Instant::now();
        match g.items.get(key) {
            Some(e) if e.live(now) => Some(e.value.clone()),
            Some(_) => {
                g.remove(key);
                None
            }
            None => None,
        }
    }

    /// Stores `value` (or deletes on `None`). Returns whether other items
    /// were evicted to make room ("forcible").
    pub fn set(
        &self,
        key: &[u8],
        value: Option<DictValue>,
        ttl: Option<f64>,
    ) -> Result<bool, DictError> {
        let mut g = self.lock();
        match value {
            None => {
                g.remove(key);
                Ok(false)
            }
            Some(v) => g.store(key, v, expiry(ttl)),
        }
    }

    /// Stores only if `key` has no live value.
    pub fn add(&self, key: &[u8], value: DictValue, ttl: Option<f64>) -> Result<bool, DictError> {
        let mut g = self.lock();
        let now = Instant::now();
        if g.items.peek(key).is_some_and(|e| e.live(now)) {
            return Err(DictError::Exists);
        }
        g.store(key, value, expiry(ttl))
    }

    /// Stores only if `key` has a live value.
    pub fn replace(
        &self,
        key: &[u8],
        value: DictValue,
        ttl: Option<f64>,
    ) -> Result<bool, DictError> {
        let mut g = self.lock();
        let now = Instant::now();
        if !g.items.peek(key).is_some_and(|e| e.live(now)) {
            return Err(DictError::NotFound);
        }
        g.store(key, value, expiry(ttl))
    }

    /// Adds `by` to a numeric value; a missing key starts from `init` (and
    /// `init_ttl`) when given. Keeps integers integral.
    pub fn incr(
        &self,
        key: &[u8],
        by: DictValue,
        init: Option<DictValue>,
        init_ttl: Option<f64>,
    ) -> Result<DictValue, DictError> {
        let mut g = self.lock();
        let now = Instant::now();
        let (current, expires) = match g.items.get(key) {
            Some(e) if e.live(now) => (e.value.clone(), e.expires),
            _ => match init {
                Some(i) => (i, expiry(init_ttl)),
                None => return Err(DictError::NotFound),
            },
        };
        let next = match (current, by) {
            (DictValue::Int(a), DictValue::Int(b)) => DictValue::Int(a.wrapping_add(b)),
            (DictValue::Int(a), DictValue::Num(b)) => DictValue::Num(a as f64 + b),
            (DictValue::Num(a), DictValue::Int(b)) => DictValue::Num(a + b as f64),
            (DictValue::Num(a), DictValue::Num(b)) => DictValue::Num(a + b),
            _ => return Err(DictError::NotANumber),
        };
        g.store(key, next.clone(), expires)?;
        Ok(next)
    }

    pub fn delete(&self, key: &[u8]) {
        self.lock().remove(key);
    }

    pub fn flush_all(&self) {
        let mut g = self.lock();
        g.items.clear();
        g.used = 0;
    }

    /// Live keys, most recently used first, at most `max` (0 = all).
    pub fn keys(&self, max: usize) -> Vec<Vec<u8>> {
        let g = self.lock();
        let now = Instant::now();
        let it = g.items.iter().filter(|(_, e)| e.live(now)).map(|(k, _)| k);
        if max == 0 {
            it.cloned().collect()
        } else {
            it.take(max).cloned().collect()
        }
    }
}

impl Inner {
    fn remove(&mut self, key: &[u8]) {
        if let Some(e) = self.items.pop(key) {
            self.used -= item_size(key, &e.value);
        }
    }

    /// Evicts least recently used items until `extra` more bytes fit.
    /// Returns whether anything was evicted.
    fn evict_until_fits(&mut self, extra: usize) -> bool {
        let mut evicted = false;
        while self.used + extra > self.capacity {
            match self.items.pop_lru() {
                Some((k, e)) => {
                    self.used -= item_size(&k, &e.value);
                    evicted = true;
                }
                None => break,
            }
        }
        evicted
    }

    fn store(
        &mut self,
        key: &[u8],
        value: DictValue,
        expires: Option<Instant>,
    ) -> Result<bool, DictError> {
        let size = item_size(key, &value);
        if size > self.capacity {
            return Err(DictError::NoMemory);
        }
        self.remove(key);
        // Expired items go first, then the least recently used.
        if self.used + size > self.capacity {
            let now = Instant::now();
            let dead: Vec<Vec<u8>> = self
                .items
                .iter()
                .filter(|(_, e)| !e.live(now))
                .map(|(k, _)| k.clone())
                .collect();
            for k in dead {
                self.remove(&k);
            }
        }
        let forcible = self.evict_until_fits(size);
        self.used += size;
        self.items.put(key.to_vec(), Entry { value, expires });
        Ok(forcible)
    }
}

fn registry() -> &'static Mutex<HashMap<String, Arc<SharedDict>>> {
    static REG: OnceLock<Mutex<HashMap<String, Arc<SharedDict>>>> = OnceLock::new();
    REG.get_or_init(Default::default)
}

/// The dictionary `name` of a generation being built: a private, empty
/// one of the size the configuration asks for, registered nowhere. The
/// build's sandbox (the script's top level run to validate it) writes into
/// it, so a build, rejected or not, never touches a live dictionary;
/// [`adopt`] swaps it for the process-wide one when the generation is
/// committed.
pub fn pending(name: &str, capacity: usize) -> Arc<SharedDict> {
    Arc::new(SharedDict::new(name, capacity))
}

/// Commits the dictionaries of a generation about to serve: each
/// [`pending`] one is replaced by the process-wide dictionary of its name
/// (contents survive reloads), which takes the pending one's size,
/// evicting least recently used items if it shrank; a name seen for the
/// first time gets a new, empty dictionary. Only the control plane calls
/// this, once the generation is accepted.
pub fn adopt(dicts: &mut BTreeMap<String, Arc<SharedDict>>) {
    let mut reg = registry().lock().unwrap_or_else(|e| e.into_inner());
    for (name, d) in dicts.iter_mut() {
        let capacity = d.capacity();
        let live = reg
            .entry(name.clone())
            .or_insert_with(|| Arc::new(SharedDict::new(name, capacity)));
        if live.capacity() != capacity {
            live.set_capacity(capacity);
        }
        *d = live.clone();
    }
}

#[cfg(test)]
use crate::config::parse_size;

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &str) -> DictValue {
        DictValue::Str(v.as_bytes().to_vec())
    }

    #[test]
    fn set_get_add_replace_delete() {
        let d = SharedDict::new("t", 1 << 20);
        assert_eq!(d.get(b"a"), None);
        assert_eq!(d.set(b"a", Some(s("1")), None), Ok(false));
        assert_eq!(d.get(b"a"), Some(s("1")));
        assert_eq!(d.add(b"a", s("2"), None), Err(DictError::Exists));
        assert_eq!(d.replace(b"b", s("2"), None), Err(DictError::NotFound));
        assert_eq!(d.replace(b"a", DictValue::Bool(true), None), Ok(false));
        assert_eq!(d.get(b"a"), Some(DictValue::Bool(true)));
        d.delete(b"a");
        assert_eq!(d.get(b"a"), None);
        assert_eq!(d.used(), 0);
        assert_eq!(d.set(b"a", Some(s("x")), None), Ok(false));
        assert_eq!(d.set(b"a", None, None), Ok(false));
        assert_eq!(d.get(b"a"), None);
    }

    #[test]
    fn incr_keeps_integers_and_needs_init_or_number() {
        let d = SharedDict::new("t", 1 << 20);
        assert_eq!(
            d.incr(b"n", DictValue::Int(1), None, None),
            Err(DictError::NotFound)
        );
        assert_eq!(
            d.incr(b"n", DictValue::Int(1), Some(DictValue::Int(10)), None),
            Ok(DictValue::Int(11))
        );
        assert_eq!(
            d.incr(b"n", DictValue::Num(0.5), None, None),
            Ok(DictValue::Num(11.5))
        );
        d.set(b"s", Some(s("x")), None).unwrap();
        assert_eq!(
            d.incr(b"s", DictValue::Int(1), None, None),
            Err(DictError::NotANumber)
        );
    }

    #[test]
    fn bounded_with_lru_eviction() {
        // Room for about 4 items of 1+8+64 bytes.
        let d = SharedDict::new("t", 4 * 73 + 10);
        for k in [b"a", b"b", b"c", b"d"] {
            assert_eq!(d.set(k, Some(DictValue::Int(1)), None), Ok(false));
        }
        // Touch "a" so "b" is the least recently used.
        assert!(d.get(b"a").is_some());
        assert_eq!(d.set(b"e", Some(DictValue::Int(1)), None), Ok(true));
        assert_eq!(d.get(b"b"), None);
        assert!(d.get(b"a").is_some());
        assert!(d.used() <= d.capacity());
        // An item larger than the whole dict is refused.
        let big = DictValue::Str(vec![b'x'; 1000]);
        assert_eq!(d.set(b"big", Some(big), None), Err(DictError::NoMemory));
    }

    #[test]
    fn expired_items_read_as_missing() {
        let d = SharedDict::new("t", 1 << 20);
        d.set(b"k", Some(DictValue::Int(1)), Some(0.001)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while d.get(b"k").is_some() {
            assert!(Instant::now() < deadline, "item never expired");
            std::thread::yield_now();
        }
        // An expired key can be added again.
        assert_eq!(d.add(b"k", DictValue::Int(2), None), Ok(false));
    }

    #[test]
    fn pending_dicts_are_private_until_adopted() {
        let mut first =
            BTreeMap::from([("adopt_test".to_string(), pending("adopt_test", 1 << 20))]);
        adopt(&mut first);
        let live = first["adopt_test"].clone();
        for i in 0..100 {
            live.set(format!("k{i}").as_bytes(), Some(DictValue::Int(i)), None)
                .unwrap();
        }
        // A smaller size being built: the live dictionary is untouched,
        // and what the build writes stays in its own copy.
        let mut next = BTreeMap::from([("adopt_test".to_string(), pending("adopt_test", 1024))]);
        next["adopt_test"].flush_all();
        next["adopt_test"]
            .set(b"x", Some(DictValue::Int(1)), None)
            .unwrap();
        assert_eq!(live.capacity(), 1 << 20);
        assert_eq!(live.keys(0).len(), 100);
        assert_eq!(live.get(b"x"), None);
        // Adopted: the same live dictionary, resized (LRU items evicted).
        adopt(&mut next);
        assert!(Arc::ptr_eq(&next["adopt_test"], &live));
        assert_eq!(live.capacity(), 1024);
        assert!(live.used() <= 1024);
        assert!(live.get(b"k99").is_some(), "the newest items stay");
        assert_eq!(live.get(b"x"), None, "the build's writes are not adopted");
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("10m"), Some(10 << 20));
        assert_eq!(parse_size("512k"), Some(512 << 10));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size(""), None);
    }
}
