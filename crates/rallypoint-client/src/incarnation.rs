//! This process's incarnation: a random number drawn once per process and stated in
//! every hello, so that the coordinator tells two processes claiming one rank apart
//! (docs/PROTOCOL.md, section 14). Every client of the process shares it (async,
//! blocking, the Python package's), as they speak for the same process.

use std::sync::Mutex;

use rand::RngCore;

/// The incarnation and the pid it was drawn for.
static DRAWN: Mutex<Option<(u32, u64)>> = Mutex::new(None);

/// This process's incarnation. A child forked after it was drawn is another process:
/// it draws its own (the pid tells them apart).
pub fn process_incarnation() -> u64 {
    let pid = std::process::id();
    let mut drawn = DRAWN.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    match *drawn {
        Some((drawn_for, incarnation)) if drawn_for == pid => incarnation,
        _ => {
            // From the OS, not a user-space generator whose state a fork would copy.
            let incarnation = rand::rngs::OsRng.next_u64();
            *drawn = Some((pid, incarnation));
            incarnation
        }
    }
}

/// A fresh job incarnation, for a reset: random, never 0 (an incarnation of zeros
/// reads like an unset one).
pub fn new_job_incarnation() -> u64 {
    loop {
        let drawn = rand::rngs::OsRng.next_u64();
        if drawn != 0 {
            return drawn;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_per_process_and_a_forked_child_draws_its_own() {
        let mine = process_incarnation();
        assert_eq!(process_incarnation(), mine);
        let mut pipe = [0; 2];
        // SAFETY: pipe(2) into a two-element array.
        assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
        // SAFETY: the child only computes, writes 8 bytes to the pipe and exits.
        let child = unsafe { libc::fork() };
        assert!(child >= 0);
        if child == 0 {
            let theirs = process_incarnation().to_le_bytes();
            // SAFETY: write(2) of an 8-byte buffer; _exit(2) without unwinding.
            unsafe {
                libc::write(pipe[1], theirs.as_ptr().cast(), theirs.len());
                libc::_exit(0);
            }
        }
        let mut theirs = [0u8; 8];
        // SAFETY: read(2) into an 8-byte buffer; waitpid(2) on our child.
        unsafe {
            assert_eq!(libc::read(pipe[0], theirs.as_mut_ptr().cast(), theirs.len()), 8);
            libc::waitpid(child, std::ptr::null_mut(), 0);
            libc::close(pipe[0]);
            libc::close(pipe[1]);
        }
        assert_ne!(u64::from_le_bytes(theirs), mine);
        assert_eq!(process_incarnation(), mine);
    }
}
