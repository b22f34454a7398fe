//! The server's state under concurrent calls: what waits for a disk and what does not.

use super::*;
use std::time::Duration;

/// A server's state for a micro SPES run of 2 nodes in `out`, round 0 published.
fn state(out: &std::path::Path) -> Arc<State> {
    let cfg = RunConfig::parse(
        "[model]\npreset = \"micro\"\n[data]\npath = \"none\"\n[train]\nmax_steps = 10\n\
         batch_size = 1\nseq_len = 16\n[sync]\nmode = \"spes\"\nnodes = 2\nsync_steps = 1\n",
        &[],
    )
    .unwrap();
    let model = spes_model::MoeModel::new(&cfg.model, Device::Cpu).unwrap();
    let layout = Layout::of(&model);
    let global: spes_sync::Named = (model.params().into_iter())
        .map(|p| (p.name, p.tensor.detach().copy()))
        .collect();
    let scope = Scope::of(&cfg.sync, cfg.model.n_experts).unwrap();
    let start = Start {
        global: shallow(&global),
        published: 0,
        gone: BTreeSet::new(),
        caps: BTreeMap::new(),
    };
    let coord = Coordinator::new(layout.clone(), scope, cfg.sync.clone(), None, start, 0.0);
    let progress: store::ServerState = serde_json::from_str(
        r#"{"format_version": 3, "fulls": [], "rounds": [{"round": 0, "tokens": 0,
            "owners": [0, 0, 0, 0, 1, 1, 1, 1], "members": [0, 1], "parts": []}],
            "initial_val_loss": null, "gone": [], "record": null}"#,
    )
    .unwrap();
    let (published, _) = watch::channel(0);
    let (wake, _) = mpsc::sync_channel(1);
    Arc::new(State {
        final_round: 10,
        coord: Mutex::new(coord),
        layout,
        limits: Limits::default(),
        cfg,
        store: Store {
            out: out.to_owned(),
            keep: 0,
            mirror: None,
        },
        served: Mutex::new(None),
        published,
        clock: Instant::now(),
        progress: Progress::new(progress, out.to_owned(), None),
        io: Mutex::new(RoundIo::default()),
        upload_slots: tokio::sync::Semaphore::new(1),
        wake,
        shard: (0, 1),
        tokenizer_xxh3: String::new(),
        watch: Mutex::new(Watch::default()),
        settle: Mutex::new(super::closer::Settle::Pinned),
    })
}

#[test]
fn a_join_waits_for_no_disk_under_the_coordinators_lock() {
    let dir = tempfile::tempdir().unwrap();
    let s = state(dir.path());
    s.join(0, 7, false, None, None).unwrap();
    // A publication's write of server.json under way, on a slow disk.
    let ((), v) = s.progress.change(|st| {
        st.gone = vec![9];
        ((), true)
    });
    let (started, release) = (mpsc::channel(), mpsc::channel::<()>());
    let slow = {
        let (s, started, release) = (s.clone(), started.0, release.1);
        std::thread::spawn(move || {
            s.progress
                .commit_with(v.unwrap(), |_| {
                    started.send(()).unwrap();
                    release.recv().unwrap();
                    Ok(())
                })
                .unwrap()
        })
    };
    started.1.recv().unwrap();
    // A heartbeat changes nothing on disk: answered at once.
    let t = Instant::now();
    s.join(0, 7, false, None, None).unwrap();
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    // A join that declares a cap waits for its write to be durable, but not holding the
    // coordinator: the round's other calls go on meanwhile.
    let capped = {
        let s = s.clone();
        std::thread::spawn(move || s.join(1, 8, false, None, Some(3)).unwrap())
    };
    let until = Instant::now() + Duration::from_secs(10);
    while s.coord.lock().unwrap().caps().get(&1) != Some(&3) {
        assert!(
            Instant::now() < until,
            "the join never reached the coordinator"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !capped.is_finished(),
        "acknowledged before its cap is on disk"
    );
    let t = Instant::now();
    assert!(s.coord.lock().unwrap().is_live(0, s.now()));
    s.join(0, 7, false, None, None).unwrap();
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    release.0.send(()).unwrap();
    slow.join().unwrap();
    capped.join().unwrap();
    let on_disk: store::ServerState =
        serde_json::from_slice(&std::fs::read(dir.path().join("server.json")).unwrap()).unwrap();
    assert_eq!(on_disk.caps, BTreeMap::from([(1, 3)]));
    assert_eq!(
        on_disk.gone,
        vec![9],
        "the newest state, the slow write's change in it"
    );
}

/// A server resumes its state only with the run's settings: a changed key is refused by name
/// (the union estimate's rule deriving another second moment than a run started with is one),
/// the liveness timing may change, and a fresh state takes whatever it is given.
#[test]
fn a_restart_with_other_run_settings_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = |sets: &[&str]| {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        RunConfig::parse(
            "[model]\npreset = \"micro\"\n[data]\npath = \"none\"\n[train]\nmax_steps = 10\n\
             batch_size = 2\nseq_len = 16\n[sync]\nmode = \"spes\"\nnodes = 2\nsync_steps = 1\n",
            &sets,
        )
        .unwrap()
    };
    let out = tmp.path();
    check_run_settings(out, &cfg(&["train.second_moment=own"]), true).unwrap();
    check_run_settings(out, &cfg(&["train.second_moment=own"]), false).unwrap();
    check_run_settings(
        out,
        &cfg(&["train.second_moment=own", "sync.lease_s=60"]),
        false,
    )
    .unwrap();
    let e = check_run_settings(out, &cfg(&[]), false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`train.second_moment` was \"own\", is now \"union_estimate\""),
        "{e}"
    );
    check_run_settings(out, &cfg(&[]), true).unwrap();
    check_run_settings(out, &cfg(&[]), false).unwrap();
}
