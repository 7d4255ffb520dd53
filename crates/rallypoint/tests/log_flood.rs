//! A peer cannot flood the coordinator's log: a connection sending thousands of
//! malformed requests, and hundreds of connections each sending garbage, cost a few
//! warning lines, while every malformed request is still answered. In its own test
//! binary because it counts the warnings of the whole process.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, BytesMut};
use rallypoint::server::{Server, ServerConfig};
use rallypoint::{Config, Identity};
use rallypoint_net::warn_limit::WarnLimit;
use rallypoint_proto::native::{
    decode_server_frame, encode_client_frame, encode_preamble, ClientFrame, FrameLimits, ServerFrame,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

/// Counts the coordinator's warnings.
struct Warnings(Arc<AtomicUsize>);

impl<S: tracing::Subscriber> Layer<S> for Warnings {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let meta = event.metadata();
        if *meta.level() == tracing::Level::WARN && meta.target().starts_with("rallypoint") {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A well-framed request with an opcode no version of the protocol uses.
fn bad_request(id: u64, out: &mut BytesMut) {
    out.put_u32_le(1 + 8 + 1);
    out.put_u8(0x02);
    out.put_u64_le(id);
    out.put_u8(0xee);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_floods_cost_a_few_log_lines() {
    let warnings = Arc::new(AtomicUsize::new(0));
    let subscriber = tracing_subscriber::registry().with(Warnings(Arc::clone(&warnings)));
    tracing::subscriber::set_global_default(subscriber).expect("subscriber");

    let test = async {
        let config = ServerConfig::new("127.0.0.1:0".parse().expect("addr"), Config::default());
        let server = Server::bind(config).await.expect("bind").spawn();
        let addr = server.local_addr();

        // One connection: 10,000 malformed requests, every one answered with Invalid.
        const BAD: u64 = 10_000;
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let mut out = BytesMut::new();
        encode_preamble(&mut out);
        encode_client_frame(&ClientFrame::Hello(Identity::anonymous("flood")), &mut out);
        for id in 1..=BAD {
            bad_request(id, &mut out);
        }
        let writer = tokio::spawn(async move {
            stream.write_all(&out).await.expect("write");
            stream
        });
        let mut stream = writer.await.expect("writer");
        let (mut buf, mut answered) = (BytesMut::new(), 0);
        while answered < BAD {
            match decode_server_frame(&mut buf, &FrameLimits::unbounded()).expect("well-formed") {
                Some(ServerFrame::Welcome(_)) => {}
                Some(ServerFrame::Reply { reply: Err(_), .. }) => answered += 1,
                Some(other) => panic!("unexpected {other:?}"),
                None => {
                    buf.reserve(64 * 1024);
                    assert!(stream.read_buf(&mut buf).await.expect("read") > 0, "closed after {answered}");
                }
            }
        }

        // Hundreds of connections of garbage, each closed.
        for _ in 0..300 {
            let mut garbage = TcpStream::connect(addr).await.expect("connect");
            let _ = garbage.write_all(b"GET / HTTP/1.1\r\n\r\n").await;
            let mut sink = Vec::new();
            let _ = garbage.read_to_end(&mut sink).await;
        }
        server.shutdown().await;
    };
    tokio::time::timeout(Duration::from_secs(120), test).await.expect("finished in time");

    // One limit for the bad requests of that connection, one for the ends of
    // connections; the test runs well inside one interval of each.
    let logged = warnings.load(Ordering::Relaxed);
    assert!(logged <= 2 * WarnLimit::FULL as usize + 2, "{logged} warnings for a flood");
    assert!(logged >= 2, "the first warnings of each kind are still shown ({logged})");
}
