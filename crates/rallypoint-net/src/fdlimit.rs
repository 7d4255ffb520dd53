//! Open-file limit: a coordinator holds one socket per worker process, and the
//! default soft limit (often 1024) is far below what a large job needs.

/// Raises the soft `RLIMIT_NOFILE` to the hard limit and returns the soft limit in
/// force afterwards (the old one if raising failed, 0 if it cannot be read).
pub fn raise_fd_limit() -> u64 {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit only writes the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "cannot read the open-file limit");
        return 0;
    }
    if limit.rlim_cur >= limit.rlim_max {
        return limit.rlim_cur;
    }
    let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
    // SAFETY: setrlimit only reads the struct we pass.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        tracing::warn!(
            error = %std::io::Error::last_os_error(),
            soft = limit.rlim_cur,
            hard = limit.rlim_max,
            "cannot raise the open-file limit"
        );
        return limit.rlim_cur;
    }
    tracing::debug!(from = limit.rlim_cur, to = raised.rlim_cur, "raised the open-file limit");
    raised.rlim_cur
}

#[cfg(test)]
mod tests {
    #[test]
    fn raises_soft_limit_to_hard() {
        let soft = super::raise_fd_limit();
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) }, 0);
        assert_eq!(soft, limit.rlim_cur);
        assert_eq!(limit.rlim_cur, limit.rlim_max);
    }
}
