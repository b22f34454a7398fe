//! c10d through the shim: two ranks as two threads of this process, over loopback.

use spes_ext::dist::{Backend, ProcessGroup, Rendezvous};
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Runs `body(group)` on ranks 0 and 1 at once and returns what each returned.
fn two_ranks<T: Send + 'static>(
    timeout: Duration,
    body: impl Fn(ProcessGroup) -> T + Send + Sync + Copy + 'static,
) -> Vec<T> {
    ranks(2, Backend::Gloo, timeout, move |g| body(g.unwrap()))
}

/// Runs `body` on `world` ranks at once, each given its attempt to join.
fn ranks<T: Send + 'static>(
    world: usize,
    backend: Backend,
    timeout: Duration,
    body: impl Fn(Result<ProcessGroup, spes_ext::ExtError>) -> T + Send + Sync + Copy + 'static,
) -> Vec<T> {
    let port = free_port();
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            std::thread::spawn(move || {
                body(ProcessGroup::join(&Rendezvous {
                    host: "127.0.0.1".into(),
                    port,
                    rank,
                    world,
                    timeout,
                    backend,
                }))
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn all_reduce_mean_and_broadcast_reach_every_tensor() {
    let out = two_ranks(Duration::from_secs(30), |g| {
        let r = g.rank() as f64;
        // Mixed shapes and dtypes: buckets split at dtype changes.
        let ts = [
            Tensor::full([3, 2], r + 1.0, (Kind::Float, Device::Cpu)),
            Tensor::full([5], 10.0 * r, (Kind::Float, Device::Cpu)),
            Tensor::full([2], r, (Kind::Double, Device::Cpu)),
        ];
        g.all_reduce_mean(&ts).unwrap();
        let b = [Tensor::full([4], r + 7.0, (Kind::Float, Device::Cpu))];
        g.broadcast(&b, 1).unwrap();
        g.barrier().unwrap();
        let v = |t: &Tensor| Vec::<f64>::try_from(&t.to_kind(Kind::Double).reshape([-1])).unwrap();
        (v(&ts[0]), v(&ts[1]), v(&ts[2]), v(&b[0]), g.world())
    });
    for (a, b, c, d, world) in out {
        assert_eq!(world, 2);
        assert_eq!(a, vec![1.5; 6]);
        assert_eq!(b, vec![5.0; 5]);
        assert_eq!(c, vec![0.5; 2]);
        assert_eq!(d, vec![8.0; 4]);
    }
}

/// Reduces started one after another run while the caller works, and each lands when finished.
#[test]
fn started_reduces_land_when_finished() {
    let out = two_ranks(Duration::from_secs(30), |g| {
        let r = g.rank() as f64;
        let first = [
            Tensor::full([1000], r, (Kind::Float, Device::Cpu)),
            Tensor::full([7], 2.0 * r, (Kind::Float, Device::Cpu)),
        ];
        let second = [Tensor::full([3], 4.0 + r, (Kind::Float, Device::Cpu))];
        let a = g.start_all_reduce_mean(&first).unwrap();
        let b = g.start_all_reduce_mean(&second).unwrap();
        // Work meanwhile; the started tensors are not touched.
        let busy = Tensor::ones([64, 64], (Kind::Float, Device::Cpu))
            .matmul(&Tensor::ones([64, 64], (Kind::Float, Device::Cpu)));
        a.finish().unwrap();
        b.finish().unwrap();
        let v = |t: &Tensor| Vec::<f64>::try_from(&t.to_kind(Kind::Double).reshape([-1])).unwrap();
        (
            v(&first[0]),
            v(&first[1]),
            v(&second[0]),
            busy.double_value(&[0, 0]),
        )
    });
    for (a, b, c, busy) in out {
        assert_eq!(a, vec![0.5; 1000]);
        assert_eq!(b, vec![1.0; 7]);
        assert_eq!(c, vec![4.5; 3]);
        assert_eq!(busy, 64.0);
    }
}

/// A reduce to one root gives that rank the means and leaves the other's tensors as they were;
/// several in flight at once, one per root (ZeRO's reduce-scatter).
#[test]
fn a_reduce_lands_on_its_root_alone() {
    let out = two_ranks(Duration::from_secs(30), |g| {
        let r = g.rank() as f64;
        let to_0 = [Tensor::full([5], 2.0 * r, (Kind::Float, Device::Cpu))];
        let to_1 = [
            Tensor::full([3], 1.0 + r, (Kind::Float, Device::Cpu)),
            Tensor::full([2], 4.0 * r, (Kind::Float, Device::Cpu)),
        ];
        let a = g.start_reduce_mean(&to_0, 0).unwrap();
        let b = g.start_reduce_mean(&to_1, 1).unwrap();
        a.finish().unwrap();
        b.finish().unwrap();
        let v = |t: &Tensor| Vec::<f64>::try_from(&t.to_kind(Kind::Double).reshape([-1])).unwrap();
        (g.rank(), v(&to_0[0]), v(&to_1[0]), v(&to_1[1]))
    });
    for (rank, a, b, c) in out {
        match rank {
            0 => {
                assert_eq!(a, vec![1.0; 5]);
                assert_eq!(b, vec![1.0; 3], "rank 0 keeps its own, not the mean");
                assert_eq!(c, vec![0.0; 2]);
            }
            _ => {
                assert_eq!(a, vec![2.0; 5], "rank 1 keeps its own, not the mean");
                assert_eq!(b, vec![1.5; 3]);
                assert_eq!(c, vec![2.0; 2]);
            }
        }
    }
}

/// A rank that never joins a collective makes the other's call fail after the timeout, as an
/// error rather than a hang or an abort.
#[test]
fn a_missing_rank_is_an_error_after_the_timeout() {
    let out = two_ranks(Duration::from_secs(2), |g| {
        if g.rank() == 0 {
            std::thread::sleep(Duration::from_secs(4));
            return None;
        }
        let start = Instant::now();
        let err = g.all_reduce_mean(&[Tensor::ones([3], (Kind::Float, Device::Cpu))]);
        Some((err.map_err(|e| e.op), start.elapsed()))
    });
    let (result, waited) = out[1].unwrap();
    assert_eq!(result, Err("all_reduce"));
    assert!(waited < Duration::from_secs(4), "waited {waited:?}");
}

/// NCCL through the shim's separately loaded part (this build must carry it: scripts/setup.sh
/// installs the headers). With GPUs, one rank per GPU (at most 2) all-reduces and broadcasts
/// CUDA tensors; without a GPU, joining an NCCL group is an error naming the cause, not a crash.
#[test]
fn nccl_runs_the_collectives_on_gpus_and_is_a_clear_error_without() {
    assert!(
        spes_ext::nccl::built(),
        "spes-ext was built without its NCCL part (see the build warning)"
    );
    let (major, minor, _) = spes_ext::nccl::version().unwrap();
    assert!(major >= 2 && minor > 0, "NCCL {major}.{minor}");
    // Loading the part loaded libtorch_cuda, whose hooks answer this.
    let gpus = if tch::Cuda::is_available() {
        tch::Cuda::device_count() as usize
    } else {
        0
    };
    if gpus == 0 {
        let out = ranks(1, Backend::Nccl, Duration::from_secs(30), |g| {
            g.err().map(|e| (e.op, e.message))
        });
        let (op, message) = out[0]
            .clone()
            .expect("an NCCL group without a GPU was made");
        assert_eq!(op, "process_group");
        assert!(message.contains("GPU"), "{message}");
        return;
    }
    let world = gpus.min(2);
    let out = ranks(world, Backend::Nccl, Duration::from_secs(60), move |g| {
        let g = g.unwrap();
        let r = g.rank() as f64;
        let dev = Device::Cuda(g.rank());
        let ts = [
            Tensor::full([3, 2], r + 1.0, (Kind::Float, dev)),
            Tensor::full([5], 10.0 * r, (Kind::BFloat16, dev)),
        ];
        // Started and finished: the reduce runs on NCCL's stream.
        g.start_all_reduce_mean(&ts).unwrap().finish().unwrap();
        let b = [Tensor::full([4], r + 7.0, (Kind::Float, dev))];
        g.broadcast(&b, world - 1).unwrap();
        g.barrier().unwrap();
        let v = |t: &Tensor| Vec::<f64>::try_from(&t.to_kind(Kind::Double).reshape([-1])).unwrap();
        (v(&ts[0]), v(&ts[1]), v(&b[0]))
    });
    let mean = |f: fn(f64) -> f64| (0..world).map(|r| f(r as f64)).sum::<f64>() / world as f64;
    for (a, b, c) in out {
        assert_eq!(a, vec![mean(|r| r + 1.0); 6]);
        assert_eq!(b, vec![mean(|r| 10.0 * r); 5]);
        assert_eq!(c, vec![(world - 1) as f64 + 7.0; 4]);
    }
}
