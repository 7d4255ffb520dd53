//! Memory a coordinator spends per idle connection (run on demand:
//! `cargo test -p rallypoint --release --test integration -- --ignored --nocapture idle`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};

use bytes::BytesMut;
use rallypoint::Identity;
use rallypoint_proto::native::{
    decode_server_frame, encode_client_frame, encode_preamble, ClientFrame, FrameLimits, ServerFrame,
};

use crate::common::{bounded, start_server};

fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("statm");
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).expect("resident pages");
    // SAFETY: sysconf has no preconditions.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64
}

/// Opens `n` welcomed, idle native connections with plain blocking sockets, which
/// cost no user-space memory on this side.
fn open_idle(addr: SocketAddr, job: &str, n: usize) -> Vec<TcpStream> {
    let mut hello = BytesMut::new();
    encode_preamble(&mut hello);
    encode_client_frame(&ClientFrame::Hello(Identity::ranked(job, 0, 1)), &mut hello);
    (0..n)
        .map(|_| {
            let mut s = TcpStream::connect(addr).expect("connect");
            s.write_all(&hello).expect("hello");
            let mut buf = BytesMut::zeroed(64);
            let mut got = 0;
            loop {
                got += s.read(&mut buf[got..]).expect("read welcome");
                let mut frame = BytesMut::from(&buf[..got]);
                if let Some(frame) = decode_server_frame(&mut frame, &FrameLimits::default()).expect("frame") {
                    assert!(matches!(frame, ServerFrame::Welcome(_)));
                    break;
                }
            }
            s
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement; run on demand"]
async fn idle_connection_memory() {
    const N: usize = 5000;
    let server = start_server().await;
    let addr = server.local_addr();
    bounded("measurement", async {
        tokio::task::spawn_blocking(move || {
            // Warm up allocator arenas, slabs and maps first.
            let warm = open_idle(addr, "warm", 500);
            let before = resident_bytes();
            let idle = open_idle(addr, "idle", N);
            // Measurement only: lets the last tasks reach their idle state after the welcome.
            std::thread::sleep(std::time::Duration::from_millis(200));
            let after = resident_bytes();
            eprintln!(
                "{N} idle connections: {} KiB resident, {} bytes per connection",
                (after - before) / 1024,
                (after - before) / N as u64
            );
            drop((warm, idle));
        })
        .await
        .expect("measure");
    })
    .await;
    server.shutdown().await;
}

/// Memory the coordinator holds for many small keys set one at a time: decoded
/// values share the allocation they were read into, so its size matters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement; run on demand"]
async fn small_values_memory() {
    const KEYS: usize = 20_000;
    let server = start_server().await;
    let client = crate::common::connect(&server, Identity::anonymous("small")).await;
    bounded("sets", async {
        client.set("warm", "up").await.expect("set");
        let before = resident_bytes();
        for i in 0..KEYS {
            client.set(format!("key-{i:06}"), format!("value-{i:06}")).await.expect("set");
        }
        let after = resident_bytes();
        eprintln!(
            "{KEYS} keys of 10+12 bytes set one by one: {} KiB resident, {} bytes per key",
            (after - before) / 1024,
            (after - before) / KEYS as u64
        );
    })
    .await;
    server.shutdown().await;
}
