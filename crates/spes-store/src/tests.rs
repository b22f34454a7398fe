use super::*;

#[test]
fn a_manifest_is_created_once_and_a_second_writer_sees_the_first_ones_content() {
    for store in [RunStore::memory(), local().1] {
        let a = Bytes::from_static(b"{\"round\": 1}");
        assert_eq!(
            store.create("state/1.json", a.clone()).unwrap(),
            Created::Written
        );
        assert_eq!(
            store
                .create("state/1.json", Bytes::from_static(b"other"))
                .unwrap(),
            Created::Exists(a.clone()),
            "{store:?}"
        );
        assert_eq!(store.get("state/1.json").unwrap(), Some(a));
        store.delete("state/1.json").unwrap();
        store.delete("state/1.json").unwrap(); // gone already: not an error
        assert_eq!(store.get("state/1.json").unwrap(), None);
    }
}

#[test]
fn files_go_up_in_parts_and_come_back_whole_with_keys_relative_to_the_prefix() {
    let (dir, store) = local();
    let big = dir.path().join("big.bin");
    // Just over one part: a multipart upload of two parts.
    let bytes: Vec<u8> = (0..PART + 4099).map(|i| (i % 251) as u8).collect();
    std::fs::write(&big, &bytes).unwrap();
    store.put_file("checkpoints/big.bin", &big).unwrap();
    let small = dir.path().join("small.bin");
    std::fs::write(&small, b"abc").unwrap();
    store.put_file("global/small.bin", &small).unwrap();
    let back = dir.path().join("back/big.bin");
    assert!(store.get_file("checkpoints/big.bin", &back).unwrap());
    assert!(std::fs::read(&back).unwrap() == bytes);
    assert!(!store.get_file("global/none.bin", &back).unwrap());
    let keys: Vec<_> = store.list("").unwrap().into_iter().map(|l| l.key).collect();
    assert_eq!(keys, ["checkpoints/big.bin", "global/small.bin"]);
    assert_eq!(store.list("global").unwrap()[0].bytes, 3);
    // Under the prefix only: the same folder one level up sees it nested.
    let up = RunStore::open(dir.path().to_str().unwrap(), &StoreOptions::default()).unwrap();
    assert!(up
        .list("")
        .unwrap()
        .iter()
        .any(|l| l.key == "store/global/small.bin"));
    store.check().unwrap();
}

#[test]
fn keys_in_a_file_others_can_read_and_plain_http_without_the_flag_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.toml");
    std::fs::write(
        &keys,
        "access_key_id = \"AKID\"\nsecret_access_key = \"very-secret\"\nendpoint = \"http://127.0.0.1:1\"\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o644)).unwrap();
    let opts = StoreOptions {
        allow_http: false,
        credentials: Some(keys.clone()),
    };
    let e = RunStore::open("s3://bucket/run", &opts)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("readable by others") && e.contains("chmod 600"),
        "{e}"
    );
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o600)).unwrap();
    let e = RunStore::open("s3://bucket/run", &opts)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("plain HTTP") && e.contains("--store-allow-http"),
        "{e}"
    );
    let allowed = StoreOptions {
        allow_http: true,
        ..opts
    };
    let store = RunStore::open("s3://bucket/run", &allowed).unwrap();
    assert!(!format!("{store:?}").contains("very-secret"));
    std::fs::write(
        &keys,
        "access_key_id = \"AKID\"\nsecret = \"very-secret\"\n",
    )
    .unwrap();
    let e = RunStore::open("s3://bucket/run", &allowed)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("not a credentials file") && !e.contains("very-secret"),
        "{e}"
    );
    let e = RunStore::open("ftp://x/y", &allowed)
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown scheme"), "{e}");
}

fn local() -> (tempfile::TempDir, RunStore) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}/store", dir.path().display());
    let store = RunStore::open(&url, &StoreOptions::default()).unwrap();
    (dir, store)
}

#[test]
fn urls_are_presigned_by_object_stores_not_local_disks_and_logged_without_their_signature() {
    let (dir, store) = local();
    assert!(!store.presigns());
    assert_eq!(
        store.presign_get("a", Duration::from_secs(60)).unwrap(),
        None
    );
    let keys = dir.path().join("keys.toml");
    std::fs::write(
        &keys,
        "access_key_id = \"key-id\"\nsecret_access_key = \"key-secret\"\n\
         endpoint = \"http://127.0.0.1:9\"\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o600)).unwrap();
    let opts = StoreOptions {
        allow_http: true,
        credentials: Some(keys),
    };
    // Signed locally, without a call: a store that is not there still signs.
    let s3 = RunStore::open("s3://bucket/run", &opts).unwrap();
    let url = s3
        .presign_get("global/round-000001.delta.parts", Duration::from_secs(60))
        .unwrap()
        .unwrap();
    assert!(
        url.contains("X-Amz-Signature=") && url.contains("X-Amz-Expires=60"),
        "{url}"
    );
    assert_eq!(
        links::redact(&url),
        "http://127.0.0.1:9/bucket/run/global/round-000001.delta.parts"
    );
    // The method is signed: a PUT URL of the same object is another URL.
    let put = s3
        .presign_put("global/round-000001.delta.parts", Duration::from_secs(60))
        .unwrap()
        .unwrap();
    assert_ne!(put, url);
}

#[test]
fn a_broken_download_resumes_with_a_range_get_from_its_last_byte_and_a_lost_request_is_sent_again()
{
    use std::io::{BufRead, BufReader, Write as _};
    let body: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!(
        "http://{}/bucket/key?X-Amz-Signature=secret",
        listener.local_addr().unwrap()
    );
    let served = body.clone();
    // The first connection closes without an answer (a kept-alive connection the store
    // dropped), the next answer breaks after 4,000 of the bytes asked for, the next ones
    // serve in full; each answer closes its connection, so none is reused.
    let server = std::thread::spawn(move || {
        let mut ranges = Vec::new();
        for (silent, broken) in [(true, false), (false, true), (false, false), (false, false)] {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut range = String::new();
            loop {
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                if let Some(r) = line.to_ascii_lowercase().strip_prefix("range: bytes=") {
                    range = r.trim().to_owned();
                }
                if line == "\r\n" {
                    break;
                }
            }
            let (from, to) = range.split_once('-').unwrap();
            let (from, to): (usize, usize) = (from.parse().unwrap(), to.parse().unwrap());
            ranges.push((from, to));
            let mut s = stream;
            if silent {
                continue;
            }
            let len = to + 1 - from;
            write!(
                s,
                "HTTP/1.1 206 Partial Content\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"
            )
            .unwrap();
            let end = if broken { from + 4000 } else { to + 1 };
            s.write_all(&served[from..end]).unwrap();
        }
        ranges
    });
    let reader = links::LinkReader::new().unwrap();
    let rt = runtime();
    let mut got = Vec::new();
    let gets = rt
        .block_on(reader.read(&url, &[1000..9000, 9500..10_000], &mut got, |_| {}))
        .unwrap();
    assert_eq!(got, [&body[1000..9000], &body[9500..]].concat());
    assert_eq!(gets, 4);
    assert_eq!(
        server.join().unwrap(),
        [(1000, 8999), (1000, 8999), (5000, 8999), (9500, 9999)]
    );
}
