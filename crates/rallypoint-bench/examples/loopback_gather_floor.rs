//! The machine's floor for an all-gather round over loopback TCP, with no
//! coordinator logic at all: N blocking connections between a client thread and a
//! server thread. Each round every client sends 16 bytes, then the server writes
//! every connection N × SIZE bytes (the size of an all-gather reply, from one buffer
//! it never copies) and the client reads them all. What remains is the kernel's
//! part: N² × SIZE bytes copied into socket buffers and out of them again, which
//! every implementation that hands each rank all the values over its own socket pays.
//! Used in docs/BENCHMARKS.md to show what part of an all-gather round is the kernel's.
//!
//! `cargo run --release -p rallypoint-cli --example loopback_gather_floor -- 1024 1024 5`
//! (clients, bytes per rank, rounds)

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// Unmeasured rounds first.
const WARMUP: usize = 1;

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let clients: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1024);
    let size: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1024);
    let rounds: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(5);
    let reply_len = clients * size;
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let server = std::thread::spawn(move || serve(&listener, clients, reply_len, rounds + WARMUP));
    let mut conns = Vec::with_capacity(clients);
    for _ in 0..clients {
        let c = TcpStream::connect(addr)?;
        c.set_nodelay(true)?;
        conns.push(c);
    }
    let request = [7u8; 16];
    let mut reply = vec![0u8; reply_len];
    let mut times = Vec::with_capacity(rounds);
    for round in 0..rounds + WARMUP {
        let start = Instant::now();
        for c in &mut conns {
            c.write_all(&request)?;
        }
        // The server writes the connections in this order, so reading them one after
        // the other keeps both threads busy as long as the socket buffers allow.
        for c in &mut conns {
            c.read_exact(&mut reply)?;
        }
        if round >= WARMUP {
            times.push(start.elapsed());
        }
    }
    drop(conns);
    server.join().expect("server thread")?;
    times.sort();
    let median = times[times.len() / 2];
    let mean = times.iter().sum::<Duration>() / times.len() as u32;
    println!(
        "{{\"clients\":{clients},\"value_bytes\":{size},\"reply_bytes\":{reply_len},\"rounds\":{rounds},\"median_us\":{:.1},\"mean_us\":{:.1},\"min_us\":{:.1}}}",
        median.as_secs_f64() * 1e6,
        mean.as_secs_f64() * 1e6,
        times[0].as_secs_f64() * 1e6
    );
    Ok(())
}

fn serve(listener: &TcpListener, clients: usize, reply_len: usize, rounds: usize) -> std::io::Result<()> {
    let mut conns = Vec::with_capacity(clients);
    for _ in 0..clients {
        let (c, _) = listener.accept()?;
        c.set_nodelay(true)?;
        conns.push(c);
    }
    let reply = vec![1u8; reply_len];
    let mut request = [0u8; 16];
    for _ in 0..rounds {
        for c in &mut conns {
            c.read_exact(&mut request)?;
        }
        for c in &mut conns {
            c.write_all(&reply)?;
        }
    }
    Ok(())
}
