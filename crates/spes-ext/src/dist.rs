//! torch.distributed's c10d inside one node: a process group over a TCPStore rendezvous with
//! the Gloo backend (CPU, or CUDA tensors staged through the host) or NCCL (one GPU per rank),
//! and the collectives data parallelism needs, on whole lists of tensors (flattened into
//! buckets so many small tensors cost a few calls).

use crate::{check, handles, ExtError};
use std::ffi::{c_char, c_void, CString};
use std::time::Duration;
use tch::Tensor;
use torch_sys::C_tensor;

extern "C" {
    fn spes_ext_pg_new(
        host: *const c_char,
        port: i32,
        rank: i32,
        world: i32,
        timeout_ms: i64,
        factory: Option<crate::nccl::Factory>,
        out: *mut *mut c_void,
    ) -> *mut c_char;
    fn spes_ext_pg_free(group: *mut c_void);
    fn spes_ext_pg_broadcast(
        group: *mut c_void,
        ts: *const *const C_tensor,
        n: usize,
        root: i32,
        bucket_bytes: usize,
    ) -> *mut c_char;
    fn spes_ext_pg_barrier(group: *mut c_void) -> *mut c_char;
    fn spes_ext_pg_reduce_mean_start(
        group: *mut c_void,
        ts: *const *const C_tensor,
        n: usize,
        root: i32,
        bucket_bytes: usize,
        out: *mut *mut c_void,
    ) -> *mut c_char;
    fn spes_ext_pending_finish(pending: *mut c_void) -> *mut c_char;
}

/// The c10d backend that carries a group's collectives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// ProcessGroupGloo: CPU tensors, or CUDA tensors through host memory.
    Gloo,
    /// ProcessGroupNCCL: CUDA tensors, each rank on its own GPU ([`crate::nccl`]).
    Nccl,
}

/// Where and how ranks meet: rank 0 serves the store at `host:port` (torchrun's MASTER_ADDR
/// and MASTER_PORT).
#[derive(Clone, Debug)]
pub struct Rendezvous {
    pub host: String,
    pub port: u16,
    pub rank: usize,
    pub world: usize,
    /// How long the rendezvous and every collective may wait for the other ranks.
    pub timeout: Duration,
    pub backend: Backend,
}

/// Bytes per flattened bucket of a collective (PyTorch DDP's default bucket size).
const BUCKET_BYTES: usize = 25 << 20;

/// A c10d process group. Collectives block until every rank has joined them (with NCCL: until
/// the GPU has queued them behind the work already there), or fail with an [`ExtError`] after
/// the rendezvous timeout (e.g. when a rank died; NCCL's watchdog ends the process instead).
pub struct ProcessGroup {
    raw: *mut c_void,
    rank: usize,
    world: usize,
}

// SAFETY: a c10d process group may be handed to another thread; it is not Sync, so it is
// never called from two threads at once.
unsafe impl Send for ProcessGroup {}

impl ProcessGroup {
    /// Joins the group described by `r`; returns once every rank has.
    pub fn join(r: &Rendezvous) -> Result<Self, ExtError> {
        let host = CString::new(r.host.as_str()).map_err(|_| ExtError {
            op: "process_group",
            message: format!("host {:?} contains a NUL byte", r.host),
        })?;
        if r.rank >= r.world {
            return Err(ExtError {
                op: "process_group",
                message: format!("rank {} is not below the world size {}", r.rank, r.world),
            });
        }
        let factory = match r.backend {
            Backend::Gloo => None,
            Backend::Nccl => Some(crate::nccl::factory()?),
        };
        let mut raw: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid C string, factory and out-pointer for the duration of the call.
        let message = unsafe {
            spes_ext_pg_new(
                host.as_ptr(),
                i32::from(r.port),
                r.rank as i32,
                r.world as i32,
                r.timeout.as_millis() as i64,
                factory,
                &mut raw,
            )
        };
        check("process_group", message)?;
        Ok(ProcessGroup {
            raw,
            rank: r.rank,
            world: r.world,
        })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Replaces every tensor, in place, by its mean over the ranks. Every rank passes the
    /// same list (shapes, dtypes, order).
    pub fn all_reduce_mean(&self, ts: &[Tensor]) -> Result<(), ExtError> {
        self.start_all_reduce_mean(ts)?.finish()
    }

    /// Starts [`ProcessGroup::all_reduce_mean`] of `ts` and returns while it runs (on Gloo's
    /// threads or NCCL's stream); the tensors hold their means once [`PendingMean::finish`]
    /// returns, and must not be touched before. Every rank starts the same lists in the same
    /// order.
    pub fn start_all_reduce_mean(&self, ts: &[Tensor]) -> Result<PendingMean, ExtError> {
        self.start_mean(ts, -1, "all_reduce")
    }

    /// As [`ProcessGroup::start_all_reduce_mean`], but only rank `root` receives the means
    /// (c10d's reduce: half an all-reduce's traffic); on the other ranks the tensors keep
    /// their values. ZeRO's reduce-scatter, with each rank the root of the tensors it owns.
    pub fn start_reduce_mean(&self, ts: &[Tensor], root: usize) -> Result<PendingMean, ExtError> {
        self.start_mean(ts, root as i32, "reduce")
    }

    fn start_mean(
        &self,
        ts: &[Tensor],
        root: i32,
        op: &'static str,
    ) -> Result<PendingMean, ExtError> {
        let h = handles(ts);
        let mut raw: *mut c_void = std::ptr::null_mut();
        // SAFETY: live group, n live tensor handles and an out-pointer for the call; the
        // pending reduce holds its own references to the tensors.
        check(op, unsafe {
            spes_ext_pg_reduce_mean_start(
                self.raw,
                h.as_ptr(),
                h.len(),
                root,
                BUCKET_BYTES,
                &mut raw,
            )
        })?;
        Ok(PendingMean { raw, op })
    }

    /// Replaces every tensor, in place, by rank `root`'s.
    pub fn broadcast(&self, ts: &[Tensor], root: usize) -> Result<(), ExtError> {
        let h = handles(ts);
        // SAFETY: as for all_reduce_mean.
        check("broadcast", unsafe {
            spes_ext_pg_broadcast(self.raw, h.as_ptr(), h.len(), root as i32, BUCKET_BYTES)
        })
    }

    /// Returns once every rank has called it.
    pub fn barrier(&self) -> Result<(), ExtError> {
        // SAFETY: live group.
        check("barrier", unsafe { spes_ext_pg_barrier(self.raw) })
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // SAFETY: `raw` came from spes_ext_pg_new and is freed once.
        unsafe { spes_ext_pg_free(self.raw) }
    }
}

/// A reduce in flight, from [`ProcessGroup::start_all_reduce_mean`] or
/// [`ProcessGroup::start_reduce_mean`]. Dropping it waits for it and discards its error.
pub struct PendingMean {
    raw: *mut c_void,
    op: &'static str,
}

// SAFETY: as for ProcessGroup: used from one thread at a time.
unsafe impl Send for PendingMean {}

impl PendingMean {
    /// Waits for the reduce and writes each tensor's mean into it (on the ranks that receive).
    pub fn finish(mut self) -> Result<(), ExtError> {
        let raw = std::mem::replace(&mut self.raw, std::ptr::null_mut());
        // SAFETY: `raw` came from spes_ext_pg_reduce_mean_start and is consumed once.
        check(self.op, unsafe { spes_ext_pending_finish(raw) })
    }
}

impl Drop for PendingMean {
    fn drop(&mut self) {
        if !self.raw.is_null() {
            // SAFETY: as in finish; the error is dropped with the value.
            let _ = check(self.op, unsafe { spes_ext_pending_finish(self.raw) });
        }
    }
}
