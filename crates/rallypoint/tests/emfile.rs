//! The accept loop survives running out of file descriptors. In its own test
//! binary because it lowers the process-wide open-file limit.

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use rallypoint::server::{Server, ServerConfig};
use rallypoint::{Client, Config, ConnectOptions, Identity};
use rallypoint_proto::native::{
    decode_server_frame, encode_client_frame, encode_preamble, ClientFrame, FrameLimits, ServerFrame,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpSocket;
use tokio::sync::Notify;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

/// Signals when the server logs an accept failure at error level.
struct AcceptFailures(Arc<Notify>);

impl<S: tracing::Subscriber> Layer<S> for AcceptFailures {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let meta = event.metadata();
        if *meta.level() == tracing::Level::ERROR && meta.target() == "rallypoint_server" {
            self.0.notify_one();
        }
    }
}

fn set_soft_fd_limit(soft: libc::rlim_t) {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain rlimit calls on a local struct.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        limit.rlim_cur = soft.min(limit.rlim_max);
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
    }
}

fn open_fds() -> libc::rlim_t {
    // The directory handle itself is one of the entries; it is closed right after.
    (std::fs::read_dir("/proc/self/fd").expect("list fds").count() - 1) as libc::rlim_t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_loop_survives_running_out_of_file_descriptors() {
    let failures = Arc::new(Notify::new());
    let subscriber = tracing_subscriber::registry()
        .with(AcceptFailures(Arc::clone(&failures)))
        .with(tracing_subscriber::fmt::layer().with_test_writer());
    tracing::subscriber::set_global_default(subscriber).expect("subscriber");

    let test = async {
        let config = ServerConfig::new("127.0.0.1:0".parse().expect("addr"), Config::default());
        let server = Server::bind(config).await.expect("bind").spawn();
        let addr = server.local_addr();
        let options =
            ConnectOptions::new(addr.to_string(), Identity::anonymous("fd")).with_timeout(Duration::from_secs(10));
        let before = Client::connect_with(options).await.expect("connect before the squeeze");
        before.set("k", "v").await.expect("set");

        // Sockets made now, connected once no descriptor is left for the server to accept with.
        let sockets: Vec<TcpSocket> = (0..4).map(|_| TcpSocket::new_v4().expect("socket")).collect();
        set_soft_fd_limit(open_fds());
        let mut pending = Vec::new();
        for socket in sockets {
            pending.push(socket.connect(addr).await.expect("connect completes in the kernel backlog"));
        }
        failures.notified().await;
        // The existing connection is unaffected while the server cannot accept.
        assert_eq!(before.get("k", None).await.expect("get during the squeeze"), "v");

        set_soft_fd_limit(libc::RLIM_INFINITY);
        let mut hello = BytesMut::new();
        encode_preamble(&mut hello);
        encode_client_frame(&ClientFrame::Hello(Identity::anonymous("fd")), &mut hello);
        for mut stream in pending {
            stream.write_all(&hello).await.expect("hello");
            let mut buf = BytesMut::new();
            let frame = loop {
                if let Some(frame) = decode_server_frame(&mut buf, &FrameLimits::default()).expect("frame") {
                    break frame;
                }
                buf.reserve(256);
                assert!(stream.read_buf(&mut buf).await.expect("read") > 0, "closed without a welcome");
            };
            assert!(matches!(frame, ServerFrame::Welcome(_)), "{frame:?}");
        }
        before.close().await.expect("close");
        server.shutdown().await;
    };
    tokio::time::timeout(Duration::from_secs(60), test).await.expect("finished in time");
}
