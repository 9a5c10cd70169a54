//! A small mutation fuzzer that runs as an ordinary `cargo test` on the stable toolchain
//! (no nightly, no libFuzzer): each target mutates a committed seed corpus and checks
//! that the code under test never panics, never hangs and never makes an absurd
//! allocation.
//!
//! Shared by the fuzz targets of several crates (`#[path]`-included):
//! `services/core/tests/fuzz_request.rs`, `fuzz_event.rs`,
//! `services/accounts/tests/fuzz_ledger.rs`, `services/audio/tests/fuzz.rs`,
//! `services/demucs/tests/fuzz_checkpoint.rs`.
//!
//! * Corpus: `<crate>/tests/corpus/<target>/` holds the seeds (every plain file);
//!   `regressions/` under it holds inputs that once crashed, replayed first on every run.
//! * `STEMQ_FUZZ_SECS` (default 3) is how long each target mutates after the replay;
//!   `scripts/test.sh` sets 60 in CI. `STEMQ_FUZZ_SEED` fixes the RNG seed (printed on
//!   every run, so a failure replays exactly); `STEMQ_FUZZ_INPUT=FILE` runs one file.
//! * A crash (a panic escaping the check, an input running longer than
//!   `STEMQ_FUZZ_INPUT_TIMEOUT` seconds, default 10, or one allocation over
//!   `STEMQ_FUZZ_MAX_ALLOC_MB`, default 256) writes the input to
//!   `target/tmp/fuzz-crashes/<target>/` and fails the test with the path; commit it
//!   under `regressions/` together with the fix.
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

/// What one target fuzzes.
pub struct Target {
    /// Short name, used for the crash folder (`request`, `audio`, ...).
    pub name: &'static str,
    /// The corpus folder (seeds; `regressions/` inside).
    pub corpus: PathBuf,
    /// Tokens worth inserting or writing over (JSON keys, magic numbers, ...).
    pub dictionary: &'static [&'static [u8]],
    /// Longest input made by mutation.
    pub max_len: usize,
}

/// Fails allocations larger than the limit, after saving the input that asked.
struct CappedAlloc;

static MAX_ALLOC: AtomicUsize = AtomicUsize::new(256 << 20);
static CURRENT: Mutex<Option<(PathBuf, Vec<u8>)>> = Mutex::new(None);

// SAFETY: forwards every call to the system allocator unchanged; an oversized request
// returns null, which the allocation API reports through `handle_alloc_error`.
unsafe impl GlobalAlloc for CappedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > MAX_ALLOC.load(Ordering::Relaxed) {
            oversized(layout.size());
            return std::ptr::null_mut();
        }
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > MAX_ALLOC.load(Ordering::Relaxed) {
            oversized(layout.size());
            return std::ptr::null_mut();
        }
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > MAX_ALLOC.load(Ordering::Relaxed) {
            oversized(new_size);
            return std::ptr::null_mut();
        }
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOC: CappedAlloc = CappedAlloc;

/// Saves the running input before the process aborts on the failed allocation.
fn oversized(size: usize) {
    static ONCE: AtomicBool = AtomicBool::new(false);
    if ONCE.swap(true, Ordering::SeqCst) {
        return;
    }
    if let Ok(guard) = CURRENT.try_lock() {
        if let Some((dir, input)) = guard.as_ref() {
            let path = save(dir, "alloc", input);
            eprintln!("fuzz: an allocation of {size} bytes was refused; the input is saved at {}", path.display());
        }
    }
}

/// A SplitMix64 generator: deterministic from its seed, no dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }
}

const INTERESTING: [u64; 20] = [
    0,
    1,
    2,
    8,
    16,
    0x7F,
    0x80,
    0xFF,
    0x100,
    0x7FFF,
    0x8000,
    0xFFFF,
    44_100,
    0x7FFF_FFFF,
    0x8000_0000,
    0xFFFF_FFFF,
    0x1_0000_0000,
    i64::MAX as u64,
    1 << 63,
    u64::MAX,
];

/// One random change to `data` (which may end up empty).
fn mutate_once(data: &mut Vec<u8>, rng: &mut Rng, pool: &[Vec<u8>], dict: &[&[u8]]) {
    let len = data.len();
    match rng.below(11) {
        0 if len > 0 => {
            let i = rng.below(len);
            data[i] ^= 1 << rng.below(8);
        }
        1 if len > 0 => {
            let i = rng.below(len);
            data[i] = rng.next() as u8;
        }
        2 if len > 0 => {
            let v = INTERESTING[rng.below(INTERESTING.len())];
            let width = [1, 2, 4, 8][rng.below(4)];
            let bytes = if rng.chance(2) { v.to_le_bytes() } else { v.to_be_bytes() };
            let bytes =
                if bytes[0] == 0 && width < 8 && !rng.chance(2) { &bytes[8 - width..] } else { &bytes[..width] };
            let i = rng.below(len);
            for (k, b) in bytes.iter().enumerate() {
                if let Some(x) = data.get_mut(i + k) {
                    *x = *b;
                }
            }
        }
        3 if len > 0 => data.truncate(rng.below(len)),
        4 if len > 0 => {
            let a = rng.below(len);
            let n = 1 + rng.below((len - a).min(64));
            data.drain(a..a + n);
        }
        5 => {
            let at = rng.below(len + 1);
            let n = 1 + rng.below(16);
            let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
            data.splice(at..at, bytes);
        }
        6 if len > 0 => {
            let a = rng.below(len);
            let n = 1 + rng.below((len - a).min(256));
            let chunk = data[a..a + n].to_vec();
            let at = rng.below(len + 1);
            data.splice(at..at, chunk);
        }
        7 if !pool.is_empty() => {
            let other = &pool[rng.below(pool.len())];
            let cut = rng.below(len + 1);
            let from = rng.below(other.len() + 1);
            data.truncate(cut);
            data.extend_from_slice(&other[from..]);
        }
        8 | 9 if !dict.is_empty() => {
            let tok = dict[rng.below(dict.len())];
            let at = rng.below(len + 1);
            if rng.chance(2) || at + tok.len() > len {
                data.splice(at..at, tok.iter().copied());
            } else {
                data[at..at + tok.len()].copy_from_slice(tok);
            }
        }
        _ if len > 0 => {
            let i = rng.below(len);
            let delta = 1 + rng.below(16) as u8;
            data[i] = if rng.chance(2) { data[i].wrapping_add(delta) } else { data[i].wrapping_sub(delta) };
        }
        _ => data.push(rng.next() as u8),
    }
}

/// A new input: a seed with one to eight changes.
pub fn mutate(rng: &mut Rng, pool: &[Vec<u8>], dict: &[&[u8]], max_len: usize) -> Vec<u8> {
    let mut data = if pool.is_empty() { Vec::new() } else { pool[rng.below(pool.len())].clone() };
    let most = if rng.chance(4) { 8 } else { 3 };
    let n = 1 + rng.below(most);
    for _ in 0..n {
        mutate_once(&mut data, rng, pool, dict);
    }
    data.truncate(max_len);
    data
}

/// A corpus file: its path and bytes.
pub type Named = (PathBuf, Vec<u8>);

/// Every plain file in `dir` but `README.md` and dot files, sorted by name.
pub fn read_dir(dir: &Path) -> Vec<Named> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| !n.starts_with('.') && n != "README.md"))
        .collect();
    files.sort();
    files.into_iter().map(|p| (p.clone(), std::fs::read(&p).expect("corpus file"))).collect()
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim();
    match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => v.parse().ok(),
    }
}

fn fnv(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3))
}

fn save(dir: &Path, kind: &str, input: &[u8]) -> PathBuf {
    let _ = std::fs::create_dir_all(dir);
    let path = dir.join(format!("{kind}-{:016x}.bin", fnv(input)));
    let _ = std::fs::write(&path, input);
    path
}

thread_local! {
    /// True while an input runs: its panics are recorded, not printed.
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

/// The last panic of an input (message and place), and how many there were.
static LAST_PANIC: Mutex<Option<String>> = Mutex::new(None);
static PANICS: AtomicUsize = AtomicUsize::new(0);
/// Distinct places of panics seen while inputs ran (the first 20).
static PLACES: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn install_hook() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if QUIET.with(Cell::get) {
                PANICS.fetch_add(1, Ordering::SeqCst);
                let place = info.location().map(|l| format!(" at {l}")).unwrap_or_default();
                let mut places = PLACES.lock().unwrap_or_else(|e| e.into_inner());
                if places.len() < 20 && !places.contains(&place) {
                    places.push(place.clone());
                }
                drop(places);
                let msg = info
                    .payload()
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| info.payload().downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                *LAST_PANIC.lock().unwrap_or_else(|e| e.into_inner()) = Some(format!("{msg}{place}"));
            } else {
                default(info);
            }
        }));
    });
}

/// What went wrong with one input.
enum Crash {
    Panic(Vec<u8>, String),
}

/// Where the input that is running now is, for the watchdog.
#[derive(Default)]
struct Running {
    started: Option<Instant>,
    input: Vec<u8>,
    done: bool,
}

/// Runs `target`: replays its regressions and seeds, then mutates for the configured
/// time. `check` must panic on any property it finds broken, and returns whether the
/// input was accepted (counted, so a run shows how deep it got); panics that the code
/// under test catches itself are counted and their places listed, but are not failures.
pub fn fuzz(target: Target, check: impl Fn(&[u8]) -> bool + Send + Sync + 'static) {
    static ACCEPTED: AtomicUsize = AtomicUsize::new(0);
    install_hook();
    if let Some(mb) = env_u64("STEMQ_FUZZ_MAX_ALLOC_MB") {
        MAX_ALLOC.store((mb as usize) << 20, Ordering::Relaxed);
    }
    let secs = env_u64("STEMQ_FUZZ_SECS").unwrap_or(3);
    let timeout = Duration::from_secs(env_u64("STEMQ_FUZZ_INPUT_TIMEOUT").unwrap_or(10));
    let seed = env_u64("STEMQ_FUZZ_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
    });
    let crash_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fuzz-crashes").join(target.name);
    *CURRENT.lock().unwrap() = Some((crash_dir.clone(), Vec::new()));

    // (inputs replayed as they are, seeds to mutate)
    let (fixed, seeds): (Vec<Named>, Vec<Vec<u8>>) = match std::env::var_os("STEMQ_FUZZ_INPUT") {
        Some(one) => {
            let p = PathBuf::from(one);
            let b = std::fs::read(&p).expect("STEMQ_FUZZ_INPUT");
            (vec![(p, b)], Vec::new())
        }
        None => {
            let seeds = read_dir(&target.corpus);
            assert!(!seeds.is_empty(), "no seeds in {}", target.corpus.display());
            let mut fixed = read_dir(&target.corpus.join("regressions"));
            let pool: Vec<Vec<u8>> = seeds.iter().map(|(_, b)| b.clone()).collect();
            fixed.extend(seeds);
            (fixed, pool)
        }
    };
    eprintln!(
        "fuzz {}: seed 0x{seed:016x} (replay with STEMQ_FUZZ_SEED=0x{seed:016x}), {} fixed inputs, {secs} s of mutation",
        target.name,
        fixed.len()
    );

    let running = Arc::new(Mutex::new(Running::default()));
    let worker = {
        let running = running.clone();
        let name = target.name;
        std::thread::Builder::new()
            .name(format!("fuzz-{name}"))
            .spawn(move || -> (u64, Option<Crash>) {
                let run = |input: &[u8]| -> Option<Crash> {
                    {
                        let mut r = running.lock().unwrap();
                        r.started = Some(Instant::now());
                        r.input.clear();
                        r.input.extend_from_slice(input);
                    }
                    if let Some(c) = CURRENT.lock().unwrap().as_mut() {
                        c.1.clear();
                        c.1.extend_from_slice(input);
                    }
                    QUIET.with(|q| q.set(true));
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        if check(input) {
                            ACCEPTED.fetch_add(1, Ordering::Relaxed);
                        }
                    }));
                    QUIET.with(|q| q.set(false));
                    running.lock().unwrap().started = None;
                    match r {
                        Ok(()) => None,
                        Err(_) => {
                            let msg = LAST_PANIC.lock().unwrap().take().unwrap_or_default();
                            Some(Crash::Panic(input.to_vec(), msg))
                        }
                    }
                };
                let mut count = 0u64;
                for (path, input) in &fixed {
                    count += 1;
                    if let Some(Crash::Panic(i, m)) = run(input) {
                        return (count, Some(Crash::Panic(i, format!("{m} (replaying {})", path.display()))));
                    }
                }
                let deadline = Instant::now() + Duration::from_secs(secs);
                let mut rng = Rng::new(seed);
                if !seeds.is_empty() {
                    while Instant::now() < deadline {
                        let input = mutate(&mut rng, &seeds, target.dictionary, target.max_len);
                        count += 1;
                        if let Some(c) = run(&input) {
                            return (count, Some(c));
                        }
                    }
                }
                running.lock().unwrap().done = true;
                (count, None)
            })
            .expect("spawn the fuzz thread")
    };

    // The watchdog: an input that runs past the timeout is a hang.
    loop {
        std::thread::sleep(Duration::from_millis(20));
        if worker.is_finished() {
            break;
        }
        let r = running.lock().unwrap();
        if let Some(t) = r.started {
            if t.elapsed() > timeout {
                let path = save(&crash_dir, "hang", &r.input);
                panic!(
                    "fuzz {}: an input ran longer than {timeout:?} (seed 0x{seed:016x}); saved at {}; \
                     fix it and add the file to {}/regressions/",
                    target.name,
                    path.display(),
                    target.corpus.display()
                );
            }
        }
    }
    let (count, crash) = worker.join().expect("the fuzz thread catches every panic");
    let caught = PANICS.load(Ordering::SeqCst);
    eprintln!(
        "fuzz {}: {count} inputs run, {} accepted (seed 0x{seed:016x}); {caught} panics caught inside",
        target.name,
        ACCEPTED.load(Ordering::Relaxed)
    );
    for place in PLACES.lock().unwrap().iter() {
        eprintln!("fuzz {}: a panic was caught{place}", target.name);
    }
    if let Some(Crash::Panic(input, msg)) = crash {
        let path = save(&crash_dir, "crash", &input);
        panic!(
            "fuzz {}: input {count} (seed 0x{seed:016x}) panicked: {msg}\nsaved at {}; fix it and add the file \
             to {}/regressions/",
            target.name,
            path.display(),
            target.corpus.display()
        );
    }
}
