use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use rallypoint::server::{Server, ServerConfig};
use rallypoint::{blocking, Config, ConnectOptions, Members};

use crate::common::{init_tracing, rank, LIMIT};

/// The blocking client from plain threads, against a server on its own runtime.
#[test]
fn blocking_clients_from_plain_threads() {
    init_tracing();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
    let server = runtime.block_on(async {
        let config = ServerConfig::new("127.0.0.1:0".parse().expect("addr"), Config::default());
        Server::bind(config).await.expect("bind").spawn()
    });
    let addr = server.local_addr().to_string();

    const WORLD: u32 = 4;
    let (results, done) = mpsc::channel();
    for r in 0..WORLD {
        let (addr, results) = (addr.clone(), results.clone());
        thread::spawn(move || {
            let run = || -> Result<Vec<String>, rallypoint::Error> {
                let options =
                    ConnectOptions::new(addr, rank("threads", r, WORLD)).with_timeout(Duration::from_secs(20));
                let client = blocking::Client::connect_with(options)?;
                client.set(format!("from-{r}"), format!("hello {r}"))?;
                client.barrier("written", Members::World, None)?;
                let keys: Vec<String> = (0..WORLD).map(|i| format!("from-{i}")).collect();
                let values = client.multi_get(&keys, Some(Duration::from_secs(5)))?;
                // A clone used from another thread shares the connection.
                let clone = client.clone();
                let counted = thread::spawn(move || clone.add("count", 1)).join().expect("clone thread")?;
                assert!((1..=i64::from(WORLD)).contains(&counted));
                client.barrier("counted", Members::World, None)?;
                assert_eq!(client.get("count", None)?, WORLD.to_string());
                // What a tool asks, from a thread too.
                let snapshot = client.snapshot()?;
                assert_eq!((snapshot.name.as_str(), snapshot.world_size), ("threads", Some(WORLD)));
                assert_eq!(client.jobs()?, ["threads"]);
                assert!(client.status()?.contains("threads"), "{}", client.status()?);
                client.barrier("asked", Members::World, None)?;
                client.close()?;
                Ok(values.iter().map(|v| String::from_utf8_lossy(v).into_owned()).collect())
            };
            let _ = results.send((r, run()));
        });
    }
    drop(results);
    for _ in 0..WORLD {
        let (r, result) = done.recv_timeout(LIMIT).expect("every thread reports in time");
        let values = result.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(values, (0..WORLD).map(|i| format!("hello {i}")).collect::<Vec<_>>());
    }
    runtime.block_on(server.shutdown());
}
