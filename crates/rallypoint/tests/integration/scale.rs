use std::time::{Duration, Instant};

use rallypoint::Members;
use tokio::task::JoinSet;

use crate::common::{bounded, connect, rank, start_server};

/// 1,000 clients, each on its own connection, meet at one barrier ten times, then
/// all-gather their ranks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_clients_reuse_one_barrier_ten_times() {
    const WORLD: u32 = 1000;
    let server = start_server().await;
    let started = Instant::now();

    let mut clients = JoinSet::new();
    for r in 0..WORLD {
        let identity = rank("big", r, WORLD);
        let server_addr = server.local_addr();
        clients.spawn(async move {
            let client = rallypoint::Client::connect_with(
                rallypoint::ConnectOptions::new(server_addr.to_string(), identity)
                    .with_timeout(Duration::from_secs(30)),
            )
            .await
            .expect("connect");
            for _ in 0..10 {
                client.barrier("step", Members::World, Some(Duration::from_secs(50))).await.expect("barrier");
            }
            let gathered = client
                .all_gather("ranks", Members::World, r.to_le_bytes(), Some(Duration::from_secs(50)))
                .await
                .expect("all_gather");
            client.close().await.expect("close");
            gathered
        });
    }
    let mut done = 0;
    bounded("1,000 clients", async {
        while let Some(result) = clients.join_next().await {
            let gathered = result.expect("client task");
            assert_eq!(gathered.len(), WORLD as usize);
            for (i, value) in gathered.iter().enumerate() {
                assert_eq!(value, (i as u32).to_le_bytes(), "value of rank {i}");
            }
            done += 1;
        }
    })
    .await;
    assert_eq!(done, WORLD);
    eprintln!("1,000 clients x 10 barriers + all-gather: {:?}", started.elapsed());

    // The coordinator still serves after everyone left.
    let late = connect(&server, rallypoint::Identity::anonymous("big")).await;
    bounded("set after", late.set("after", "yes")).await.expect("set after");
    server.shutdown().await;
}
