//! Counts the process's top-level ATen operator calls (no operator call around them on their
//! thread) by the phase of a training step that made them: what `spes bench step --count-ops`
//! prints. A libtorch RecordFunction callback, installed only between [`start`] and [`stop`];
//! phases are marked with [`enter`] whether or not anything counts (an atomic store).

use crate::{check, ExtError};

/// The part of a training step an operator call belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum Phase {
    /// Anything not marked (batches, reading losses back).
    Other = 0,
    Forward = 1,
    /// Autograd's backward and the gradients computed by hand (the LM head's).
    Backward = 2,
    /// Clipping, the AdamW update, zeroing gradients.
    Optimizer = 3,
    /// The step's compute copies and moving their gradients to the masters.
    Bookkeeping = 4,
}

/// Every phase, in the order [`OpCounts`] holds them.
pub const PHASES: [Phase; 5] = [
    Phase::Other,
    Phase::Forward,
    Phase::Backward,
    Phase::Optimizer,
    Phase::Bookkeeping,
];

/// Top-level operator calls per phase, indexed by `Phase as usize`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpCounts(pub [u64; 5]);

impl OpCounts {
    /// Calls made in `phase`.
    pub fn of(&self, phase: Phase) -> u64 {
        self.0[phase as usize]
    }
}

mod ffi {
    use std::ffi::c_char;
    extern "C" {
        pub fn spes_ext_count_ops(on: bool) -> *mut c_char;
        pub fn spes_ext_set_op_phase(phase: i32) -> i32;
        pub fn spes_ext_op_counts(out: *mut u64);
        pub fn spes_ext_watch_op(name: *const c_char) -> *mut c_char;
        pub fn spes_ext_watched() -> *mut c_char;
        pub fn spes_ext_free_error(message: *mut c_char);
    }
}

/// Zeroes the counts and starts counting (every thread of the process).
pub fn start() -> Result<(), ExtError> {
    // SAFETY: no arguments; the shim serialises installing the callback.
    check("count_ops", unsafe { ffi::spes_ext_count_ops(true) })
}

/// Stops counting; the counts stay readable.
pub fn stop() -> Result<(), ExtError> {
    // SAFETY: as for `start`.
    check("count_ops", unsafe { ffi::spes_ext_count_ops(false) })
}

/// The counts since the last [`start`].
pub fn counts() -> OpCounts {
    let mut all = [0u64; 8];
    // SAFETY: the shim writes eight values.
    unsafe { ffi::spes_ext_op_counts(all.as_mut_ptr()) };
    let mut out = [0u64; 5];
    out.copy_from_slice(&all[..5]);
    OpCounts(out)
}

/// Restores the phase that was current when it was made, when dropped.
#[must_use = "the phase lasts as long as its guard"]
pub struct PhaseGuard {
    previous: i32,
}

impl Drop for PhaseGuard {
    fn drop(&mut self) {
        // SAFETY: an atomic exchange in the shim.
        unsafe { ffi::spes_ext_set_op_phase(self.previous) };
    }
}

/// Counts later calls (of every thread) under `phase` until the guard drops.
pub fn enter(phase: Phase) -> PhaseGuard {
    // SAFETY: an atomic exchange in the shim.
    let previous = unsafe { ffi::spes_ext_set_op_phase(phase as i32) };
    PhaseGuard { previous }
}

/// Starts recording the sizes of the tensor arguments of every call of operator `op` (as
/// libtorch names it, e.g. `aten::_grouped_mm`), at any depth, forgetting earlier records.
pub fn watch(op: &str) -> Result<(), ExtError> {
    let name = std::ffi::CString::new(op).map_err(|_| ExtError {
        op: "watch_op",
        message: format!("operator name {op:?} holds a NUL"),
    })?;
    // SAFETY: a NUL-terminated name borrowed for the call (the shim copies it).
    check("watch_op", unsafe { ffi::spes_ext_watch_op(name.as_ptr()) })
}

/// Stops recording; [`watched`] still returns what was recorded.
pub fn unwatch() -> Result<(), ExtError> {
    // SAFETY: NULL asks the shim to stop.
    check("watch_op", unsafe {
        ffi::spes_ext_watch_op(std::ptr::null())
    })
}

/// The calls [`watch`] recorded, in order: for each, its tensor arguments' sizes.
pub fn watched() -> Vec<Vec<Vec<i64>>> {
    // SAFETY: the shim returns a malloc'd NUL-terminated string, freed once here.
    let text = unsafe {
        let p = ffi::spes_ext_watched();
        if p.is_null() {
            return Vec::new();
        }
        let s = std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned();
        ffi::spes_ext_free_error(p);
        s
    };
    let dims = |t: &str| -> Vec<i64> {
        t.split('x')
            .filter(|d| !d.is_empty())
            .map(|d| d.parse().expect("the shim writes integers"))
            .collect()
    };
    text.split(';')
        .filter(|c| !c.is_empty())
        .map(|call| call.split(',').map(dims).collect())
        .collect()
}
