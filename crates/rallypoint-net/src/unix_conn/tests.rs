use std::future::poll_fn;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::timeout;

use super::*;

const BOUND: Duration = Duration::from_secs(5);

fn pair() -> (UnixConn, UnixConn) {
    let (a, b) = tokio::net::UnixStream::pair().expect("socket pair");
    (UnixConn::new(a).expect("registers"), UnixConn::new(b).expect("registers"))
}

/// The events each epoll instance of this process watches the socket `fd` for
/// (`/proc/self/fdinfo` of every eventpoll descriptor), found by the socket's inode:
/// tests running beside this one reuse descriptor numbers. (The reactor holds its
/// epoll instance under two descriptors: the same line twice is one registration.)
fn registered_events(fd: BorrowedFd<'_>) -> Vec<u32> {
    let ino = format!("{:x}", rustix::fs::fstat(fd).expect("fstat").st_ino);
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd").expect("/proc/self/fd").flatten() {
        if !std::fs::read_link(entry.path()).is_ok_and(|target| target.to_string_lossy().contains("eventpoll")) {
            continue;
        }
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", entry.file_name().to_string_lossy()));
        for line in info.unwrap_or_default().lines() {
            // "tfd:       14 events:       19 data: ...  pos:0 ino:8d5f sdev:8"
            let words: Vec<&str> = line.split_whitespace().collect();
            if let ["tfd:", _, "events:", events, ..] = words[..] {
                if words.iter().any(|word| word.strip_prefix("ino:") == Some(&ino)) {
                    found.push((line.to_owned(), u32::from_str_radix(events, 16).expect("hex events")));
                }
            }
        }
    }
    found.sort();
    found.dedup();
    found.into_iter().map(|(_, events)| events).collect()
}

fn temp_path(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("rallypoint-unix-conn-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("test directory");
    dir.join("agent.sock")
}

/// A Unix socket's write space is signalled each time its peer reads: the reactor
/// must not be asked for it, or a rank asleep waiting for its reply is woken when
/// the agent reads its request.
#[tokio::test]
async fn the_socket_is_watched_for_reading_only() {
    // Both ends as they are made: a rank connecting, an agent accepting.
    let path = temp_path("watched");
    let acceptor = UnixAcceptor::bind(&path).expect("binds");
    let rank = UnixConn::connect(&path).expect("connects");
    let agent = timeout(BOUND, acceptor.accept()).await.expect("within the bound").expect("accepts");
    let (read, write) = rank.split();
    for conn in [&write, &agent] {
        let events = registered_events(conn.fd());
        assert_eq!(events.len(), 1, "watched once: {events:x?}");
        assert_eq!(events[0] & libc::EPOLLOUT as u32, 0, "watched for write space: {:x}", events[0]);
        assert_ne!(events[0] & libc::EPOLLIN as u32, 0, "not watched for reading: {:x}", events[0]);
    }
    drop(read);
    std::fs::remove_dir_all(path.parent().expect("its directory")).expect("cleanup");
}

/// The client gives up reconnecting when nothing listens (no socket file, or a
/// stale one): those must stay the errors they were.
#[tokio::test]
async fn connecting_where_nothing_listens_says_so() {
    let path = temp_path("nothing");
    let missing = UnixConn::connect(&path).err().expect("no socket there");
    assert_eq!(missing.kind(), io::ErrorKind::NotFound, "{missing}");
    drop(std::os::unix::net::UnixListener::bind(&path).expect("binds"));
    let stale = UnixConn::connect(&path).err().expect("nothing listens");
    assert_eq!(stale.kind(), io::ErrorKind::ConnectionRefused, "{stale}");
    std::fs::remove_dir_all(path.parent().expect("its directory")).expect("cleanup");
}

#[tokio::test]
async fn a_write_that_finds_the_socket_full_waits_for_room() {
    let (mut writer, mut reader) = pair();
    // Fill the socket.
    let chunk = vec![7u8; 64 * 1024];
    let mut sent = 0;
    while let Ok(n) = writer.try_write(&chunk) {
        sent += n;
    }
    assert!(sent > 0);
    assert_eq!(writer.try_write(&chunk).map_err(|e| e.kind()), Err(io::ErrorKind::WouldBlock));
    assert!(writer.room.is_none());
    // More than fits: the write waits (registered for room only meanwhile), and
    // every byte arrives once the peer reads.
    let more = vec![9u8; 1 << 20];
    let total = sent + more.len();
    let writing = tokio::spawn(async move {
        writer.write_all(&more).await.expect("written");
        assert!(writer.room.is_none(), "the wait's registration went with it");
        writer
    });
    let mut got = Vec::with_capacity(total);
    while got.len() < total {
        let mut buf = vec![0u8; 256 * 1024];
        let n = timeout(BOUND, reader.read(&mut buf)).await.expect("within the bound").expect("reads");
        assert!(n > 0, "ended early at {}", got.len());
        got.extend_from_slice(&buf[..n]);
    }
    let writer = timeout(BOUND, writing).await.expect("within the bound").expect("joined");
    assert!(got[..sent].iter().all(|&b| b == 7) && got[sent..].iter().all(|&b| b == 9));
    // And `writable` says at once that there is room again.
    timeout(BOUND, writer.writable()).await.expect("within the bound").expect("writable");
}

#[tokio::test]
async fn writable_waits_until_the_peer_reads() {
    let (writer, mut reader) = pair();
    let chunk = vec![1u8; 64 * 1024];
    while writer.try_write(&chunk).is_ok() {}
    assert!(timeout(Duration::from_millis(100), writer.writable()).await.is_err(), "full, yet writable");
    let mut buf = vec![0u8; 1 << 20];
    let waiting = tokio::spawn(async move { writer.writable().await });
    while timeout(BOUND, reader.read(&mut buf)).await.expect("within the bound").expect("reads") == buf.len() {}
    timeout(BOUND, waiting).await.expect("within the bound").expect("joined").expect("writable");
}

/// A read that takes files may be short with more bytes waiting (the kernel stops
/// after them): the next read must find those bytes without new ones coming.
#[tokio::test]
async fn bytes_after_files_are_read_without_another_wake_up() {
    let (sender, receiver) = pair();
    let (receiver, _keep) = receiver.split();
    let file = rustix::fs::memfd_create("passed", rustix::fs::MemfdFlags::CLOEXEC).expect("a memory file");
    assert_eq!(sender.try_write_with_files(b"with a file", &[file.as_fd()]).expect("sent"), 11);
    assert_eq!(sender.try_write(b" and after").expect("sent"), 10);
    let (mut buf, mut files) = (BytesMut::new(), VecDeque::new());
    let first = poll_fn(|cx| receiver.poll_recv_with_files(cx, &mut buf, 4096, &mut files));
    assert_eq!(timeout(BOUND, first).await.expect("within the bound").expect("reads"), 11);
    let rest = poll_fn(|cx| receiver.poll_recv_with_files(cx, &mut buf, 4096, &mut files));
    assert_eq!(timeout(BOUND, rest).await.expect("the rest without a wake-up").expect("reads"), 10);
    assert_eq!(&buf[..], b"with a file and after");
    assert_eq!(files.len(), 1);
}

/// After a short read the readiness is cleared; bytes that come later still wake
/// the reader.
#[tokio::test]
async fn a_reader_is_woken_for_bytes_after_a_short_read() {
    let (sender, receiver) = pair();
    let (receiver, _keep) = receiver.split();
    let (mut buf, mut files) = (BytesMut::new(), VecDeque::new());
    for round in 0..50u32 {
        let message = round.to_le_bytes();
        let sending = async {
            tokio::time::sleep(Duration::from_millis(u64::from(round % 3))).await;
            sender.try_write(&message).expect("sent")
        };
        let reading = poll_fn(|cx| receiver.poll_recv_with_files(cx, &mut buf, 4096, &mut files));
        let (sent, read) = timeout(BOUND, async { tokio::join!(sending, reading) }).await.expect("woken");
        assert_eq!((sent, read.expect("reads")), (4, 4));
        assert_eq!(&buf.split()[..], &message);
    }
}

#[tokio::test]
async fn dropping_the_write_half_ends_the_stream_for_the_peer() {
    let (conn, mut peer) = pair();
    let (read, write) = conn.split();
    write.try_write(b"last").expect("sent");
    drop(write);
    let mut got = Vec::new();
    timeout(BOUND, peer.read_to_end(&mut got)).await.expect("within the bound").expect("reads to the end");
    assert_eq!(got, b"last");
    // The read half still reads.
    peer.try_write(b"back").expect("sent");
    let mut read = read;
    let mut buf = [0u8; 4];
    timeout(BOUND, read.read_exact(&mut buf)).await.expect("within the bound").expect("reads");
    assert_eq!(&buf, b"back");
}

#[tokio::test]
async fn writing_to_a_closed_peer_is_an_error() {
    let (conn, peer) = pair();
    drop(peer);
    let error = conn.try_write(b"anyone?").expect_err("the peer is gone");
    assert_eq!(error.kind(), io::ErrorKind::BrokenPipe, "{error}");
}
