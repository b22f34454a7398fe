//! c10d through the shim: two ranks as two threads of this process, over loopback.

use spes_ext::dist::{ProcessGroup, Rendezvous};
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
    let port = free_port();
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            std::thread::spawn(move || {
                let g = ProcessGroup::join(&Rendezvous {
                    host: "127.0.0.1".into(),
                    port,
                    rank,
                    world: 2,
                    timeout,
                })
                .unwrap();
                body(g)
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
