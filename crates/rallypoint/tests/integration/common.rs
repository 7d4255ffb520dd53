//! Helpers shared by the integration tests.

use std::future::Future;
use std::time::Duration;

use rallypoint::server::{Server, ServerConfig, ServerHandle};
use rallypoint::{Client, Config, ConnectOptions, Identity};
use tokio::task::JoinHandle;

/// Upper bound for any one test step; a hang fails the test instead of the suite.
pub const LIMIT: Duration = Duration::from_secs(60);

/// Runs `future` to completion or panics naming `what` after [`LIMIT`].
pub async fn bounded<F: Future>(what: &str, future: F) -> F::Output {
    match tokio::time::timeout(LIMIT, future).await {
        Ok(output) => output,
        Err(_) => panic!("{what} did not finish within {LIMIT:?}"),
    }
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

pub async fn start_server() -> ServerHandle {
    start_server_with(Config::default()).await
}

pub async fn start_server_with(engine: Config) -> ServerHandle {
    start_server_configured(ServerConfig::new("127.0.0.1:0".parse().expect("loopback address"), engine)).await
}

/// Every server of the suite serves its plaintext native ranks on the reactor thread
/// when this is set (scripts/test runs the suite both ways).
pub const NATIVE_ON_REACTOR: &str = "RALLYPOINT_TEST_NATIVE_ON_REACTOR";

pub async fn start_server_configured(mut config: ServerConfig) -> ServerHandle {
    init_tracing();
    if std::env::var_os(NATIVE_ON_REACTOR).is_some_and(|v| v == "1") {
        config.native_on_reactor = true;
    }
    Server::bind(config).await.expect("bind on loopback").spawn()
}

/// Rank `rank` of `world` in `job`, on a made-up host and pid so errors can be checked.
pub fn rank(job: &str, rank: u32, world: u32) -> Identity {
    Identity { host: format!("host-{rank}"), pid: 1000 + rank, ..Identity::ranked(job, rank, world) }
}

pub async fn connect(server: &ServerHandle, identity: Identity) -> Client {
    let options = ConnectOptions::new(server.local_addr().to_string(), identity).with_timeout(Duration::from_secs(20));
    Client::connect_with(options).await.expect("connect to the test server")
}

/// Starts `op` on its own task and returns once the coordinator has received it.
///
/// The op's request is sent on its first poll; a later request on the same
/// connection is handled after it, so that request's reply proves the arrival.
pub async fn start_confirmed<T: Send + 'static>(
    client: &Client,
    op: impl Future<Output = T> + Send + 'static,
) -> JoinHandle<T> {
    let mut op = Box::pin(op);
    tokio::select! {
        biased;
        _ = &mut op => panic!("the operation finished before anything else happened"),
        () = std::future::ready(()) => {}
    }
    bounded("confirming request", client.num_keys()).await.expect("num_keys after the op");
    tokio::spawn(op)
}
