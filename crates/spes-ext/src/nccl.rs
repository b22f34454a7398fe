//! The CUDA part of the shim: csrc/nccl.cpp (NCCL process groups and what a CUDA device is),
//! built by `build.rs` into a shared library linked against libtorch_cuda and embedded here. It
//! is written to a cache file and loaded only when a process group asks for NCCL or a device
//! is queried, after libtorch's CUDA backend is loaded, so a binary built with it still starts
//! where there is no CUDA at all.

use crate::ExtError;
use std::ffi::{c_char, c_void};
use std::sync::OnceLock;

/// nccl.cpp's `spes_nccl_backend_new`, as c10d.cpp's `spes_ext_pg_new` takes it.
pub(crate) type Factory = unsafe extern "C" fn(
    store: *mut c_void,
    rank: i32,
    world: i32,
    timeout_ms: i64,
    out: *mut *mut c_void,
) -> *mut c_char;

/// nccl.cpp's `spes_cuda_device`.
type DeviceQuery = unsafe extern "C" fn(
    device: i32,
    major: *mut i32,
    minor: *mut i32,
    name: *mut c_char,
    name_len: usize,
) -> *mut c_char;

struct Loaded {
    factory: Factory,
    version: i32,
    device: DeviceQuery,
}

/// What a CUDA device is: its compute capability (9.0 for H100 and H200) and name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaDevice {
    pub major: i32,
    pub minor: i32,
    pub name: String,
}

/// CUDA device `index` as libtorch sees it; loads the part (libtorch's CUDA backend must be
/// loaded first). An error without the part or without CUDA.
pub fn cuda_device(index: usize) -> Result<CudaDevice, ExtError> {
    let query = load()?.device;
    let (mut major, mut minor) = (0, 0);
    let mut name = [0 as c_char; 256];
    // SAFETY: the buffers are as long as the call is told; the message is the shim's.
    let message = unsafe {
        query(
            index as i32,
            &mut major,
            &mut minor,
            name.as_mut_ptr(),
            name.len(),
        )
    };
    crate::check("cuda_device", message)?;
    // SAFETY: the shim NUL-terminates the name within the buffer.
    let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    Ok(CudaDevice { major, minor, name })
}

#[cfg(spes_nccl)]
const LIBRARY: Option<&[u8]> = Some(include_bytes!(env!("SPES_NCCL_SO")));
#[cfg(not(spes_nccl))]
const LIBRARY: Option<&[u8]> = None;

fn error(message: String) -> ExtError {
    ExtError {
        op: "nccl",
        message,
    }
}

/// Whether this build carries the NCCL part (its build found the CUDA and NCCL headers).
pub fn built() -> bool {
    LIBRARY.is_some()
}

/// The NCCL version the part was built against, as (major, minor, patch); loads the part.
pub fn version() -> Result<(u32, u32, u32), ExtError> {
    let v = load()?.version as u32;
    // NCCL_VERSION_CODE since 2.9: major·10000 + minor·100 + patch.
    Ok((v / 10000, (v / 100) % 100, v % 100))
}

pub(crate) fn factory() -> Result<Factory, ExtError> {
    Ok(load()?.factory)
}

fn load() -> Result<&'static Loaded, ExtError> {
    static LOADED: OnceLock<Result<Loaded, String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let bytes = LIBRARY.ok_or_else(|| {
                "this spes was built without its NCCL part: spes-ext's build found no CUDA or \
                 NCCL headers (run scripts/setup.sh on a machine whose PyTorch wheel has CUDA, \
                 then rebuild), so data parallel on GPUs can only use Gloo"
                    .to_string()
            })?;
            open(bytes)
        })
        .as_ref()
        .map_err(|m| error(m.clone()))
}

fn open(bytes: &[u8]) -> Result<Loaded, String> {
    let path = materialize(bytes)?;
    // SAFETY: the library only defines three C functions and runs no initialisers of its own;
    // its dependencies are libtorch's, already loaded by the caller. Kept for the process.
    let lib = unsafe {
        libloading::os::unix::Library::open(
            Some(&path),
            libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_LOCAL,
        )
    }
    .map_err(|e| {
        format!(
            "cannot load spes's NCCL part {} (it needs libtorch_cuda and NCCL from the PyTorch \
             wheel): {e}",
            path.display()
        )
    })?;
    // SAFETY: the symbols have exactly these C signatures in csrc/nccl.cpp.
    let loaded = unsafe {
        let factory = *lib
            .get::<Factory>(b"spes_nccl_backend_new\0")
            .map_err(|e| e.to_string())?;
        let version = lib
            .get::<unsafe extern "C" fn() -> i32>(b"spes_nccl_version\0")
            .map_err(|e| e.to_string())?();
        let device = *lib
            .get::<DeviceQuery>(b"spes_cuda_device\0")
            .map_err(|e| e.to_string())?;
        Loaded {
            factory,
            version,
            device,
        }
    };
    std::mem::forget(lib);
    Ok(loaded)
}

/// Writes the embedded library to `<temp>/spes-<uid>/libspes_nccl-<version>-<hash>.so` unless
/// a process already did (a temporary name, then a rename), and returns the path. The directory
/// must be this user's and closed to others, since whatever lies there gets loaded.
fn materialize(bytes: &[u8]) -> Result<std::path::PathBuf, String> {
    use std::hash::{Hash, Hasher};
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    let dir = std::env::temp_dir().join(format!("spes-{uid}"));
    let fail =
        |e: std::io::Error| format!("cannot write spes's NCCL part to {}: {e}", dir.display());
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(fail)?;
    let meta = std::fs::symlink_metadata(&dir).map_err(fail)?;
    if !meta.is_dir() || meta.uid() != uid || meta.mode() & 0o077 != 0 {
        return Err(format!(
            "{} must be a directory of user {uid} closed to others (mode 700) to hold spes's NCCL part",
            dir.display()
        ));
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    let path = dir.join(format!(
        "libspes_nccl-{}-{:016x}.so",
        env!("CARGO_PKG_VERSION"),
        h.finish()
    ));
    if std::fs::read(&path).is_ok_and(|b| b == bytes) {
        return Ok(path);
    }
    let tmp = dir.join(format!("libspes_nccl.so.{}", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(fail)?;
    std::fs::rename(&tmp, &path).map_err(fail)?;
    Ok(path)
}
