//! The machine's floor for one request and one reply per client per round over
//! loopback TCP, with no coordinator logic at all: a bare epoll echo server thread and
//! a client thread with N blocking connections; each round every client sends 16
//! bytes, then every client reads its echo. Used in docs/BENCHMARKS.md to show what
//! part of a barrier round is the kernel's.
//!
//! `cargo run --release -p rallypoint-cli --example loopback_floor -- 1024 200`

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let clients: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1024);
    let rounds: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(200);
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let stop = Arc::new(AtomicBool::new(false));
    let server = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || echo_server(listener, clients, &stop))
    };
    let mut conns = Vec::with_capacity(clients);
    for _ in 0..clients {
        let c = TcpStream::connect(addr)?;
        c.set_nodelay(true)?;
        conns.push(c);
    }
    let msg = [7u8; 16];
    let mut buf = [0u8; 16];
    let mut times = Vec::with_capacity(rounds);
    for round in 0..rounds + 5 {
        let start = Instant::now();
        for c in &mut conns {
            c.write_all(&msg)?;
        }
        for c in &mut conns {
            c.read_exact(&mut buf)?;
        }
        if round >= 5 {
            times.push(start.elapsed());
        }
    }
    stop.store(true, Ordering::Relaxed);
    drop(conns);
    let _ = server.join();
    times.sort();
    let median = times[times.len() / 2];
    let mean = times.iter().sum::<Duration>() / times.len() as u32;
    println!(
        "{{\"clients\":{clients},\"rounds\":{rounds},\"median_us\":{:.1},\"mean_us\":{:.1}}}",
        median.as_secs_f64() * 1e6,
        mean.as_secs_f64() * 1e6
    );
    Ok(())
}

fn echo_server(listener: TcpListener, clients: usize, stop: &AtomicBool) {
    let mut conns = Vec::with_capacity(clients);
    // SAFETY: plain epoll syscalls on descriptors owned by `conns`, which outlives them.
    let epfd = unsafe { libc::epoll_create1(0) };
    for i in 0..clients {
        let Ok((c, _)) = listener.accept() else { return };
        let _ = c.set_nodelay(true);
        let _ = c.set_nonblocking(true);
        let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: i as u64 };
        unsafe { libc::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, c.as_raw_fd(), &mut ev) };
        conns.push(c);
    }
    let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 1024];
    let mut buf = [0u8; 256];
    while !stop.load(Ordering::Relaxed) {
        let n = unsafe { libc::epoll_wait(epfd, events.as_mut_ptr(), events.len() as i32, 100) };
        for ev in events.iter().take(n.max(0) as usize) {
            let c = &mut conns[ev.u64 as usize];
            if let Ok(got) = c.read(&mut buf) {
                if got > 0 {
                    let _ = c.write_all(&buf[..got]);
                }
            }
        }
    }
    unsafe { libc::close(epfd) };
}
