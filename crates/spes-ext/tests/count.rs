//! The op counter counts top-level ATen calls (not the calls inside them), by phase, on every
//! thread, and only while started; a watch records one operator's argument sizes. One test in its own binary: the counter is process-wide.

use spes_ext::count::{self, Phase};
use tch::{Device, Kind, Tensor};

#[test]
fn counts_top_level_calls_by_phase_and_only_while_started() {
    let a = Tensor::ones([4, 4], (Kind::Float, Device::Cpu));
    let b = Tensor::ones([4, 4], (Kind::Float, Device::Cpu));
    let _ = &a + &b; // Loads what the first call loads, before counting.
    count::start().unwrap();
    {
        let _f = count::enter(Phase::Forward);
        // matmul calls mm inside itself: one top-level call.
        let _ = a.matmul(&b);
        let _ = &a + &b;
        {
            let _o = count::enter(Phase::Optimizer);
            let _ = (&a * &b).sum(Kind::Float);
        }
        // Back in Forward when the inner guard dropped; another thread counts too.
        let (a2, b2) = (a.shallow_clone(), b.shallow_clone());
        std::thread::spawn(move || {
            let _ = a2.matmul(&b2);
        })
        .join()
        .unwrap();
    }
    let _ = &a - &b; // Other: nothing marked.
    count::stop().unwrap();
    let _ = a.matmul(&b); // Not counted: stopped.
    let c = count::counts();
    assert_eq!(c.of(Phase::Forward), 3, "{c:?}");
    assert_eq!(c.of(Phase::Optimizer), 2, "{c:?}");
    assert_eq!(c.of(Phase::Other), 1, "{c:?}");
    assert_eq!(c.of(Phase::Backward) + c.of(Phase::Bookkeeping), 0, "{c:?}");
    count::start().unwrap();
    assert_eq!(
        count::counts(),
        count::OpCounts::default(),
        "start zeroes the counts"
    );
    count::stop().unwrap();
}
