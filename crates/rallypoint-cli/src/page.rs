//! `--http ADDR` of `serve` and `launch`: the live page, its JSON API and the
//! metrics (crate `rallypoint-http`), next to the coordinator.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use rallypoint_core::snapshot::{LauncherView, StacksView};
use rallypoint_http::{HttpConfig, HttpError, HttpHandle, HttpServer, Panel};
use rallypoint_launch::LaunchObserver;
use rallypoint_server::{Observer, Token};

/// Refuses a page beyond loopback without a token (and without --insecure) before
/// anything starts, as the page itself would.
pub fn check_exposure(listen: SocketAddr, token: bool, insecure: bool) -> Result<(), HttpError> {
    if listen.ip().is_loopback() || token || insecure {
        Ok(())
    } else {
        Err(HttpError::Exposed { addr: listen })
    }
}

/// The line that says where the page is. A token the launcher made for the job is
/// shown in the login link (as notebook servers do: the link is how a person gets
/// in, and the token lives only as long as the job); a token the user gave is not.
pub fn announce(server: &HttpServer, token: Option<&Token>, show_token: bool) -> String {
    let url = server.url();
    match (token, show_token) {
        (None, _) => format!("rallypoint: live page at {url} (metrics at {url}metrics)"),
        (Some(token), true) => format!(
            "rallypoint: live page at {url}login?token={} (metrics at {url}metrics, with Authorization: Bearer TOKEN)",
            String::from_utf8_lossy(token.secret())
        ),
        (Some(_), false) => format!(
            "rallypoint: live page at {url} (log in at {url}login?token=TOKEN with the coordinator's token; metrics at \
             {url}metrics, with Authorization: Bearer TOKEN)"
        ),
    }
}

/// `launch --http`: starts the page once node 0's coordinator is up, and keeps the
/// launcher's view of its workers for it.
pub struct LaunchPage {
    listen: SocketAddr,
    insecure: bool,
    /// The user gave the token (else the launcher made it, and the link shows it).
    token_given: bool,
    panel: Arc<Panel>,
    /// Serving until the launcher exits.
    handle: Mutex<Option<HttpHandle>>,
}

impl LaunchPage {
    pub fn new(listen: SocketAddr, insecure: bool, token_given: bool) -> Arc<LaunchPage> {
        Arc::new(LaunchPage { listen, insecure, token_given, panel: Arc::default(), handle: Mutex::new(None) })
    }
}

impl std::fmt::Debug for LaunchPage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaunchPage").field("listen", &self.listen).finish_non_exhaustive()
    }
}

impl LaunchObserver for LaunchPage {
    fn coordinator(&self, observer: Observer, token: Option<Arc<Token>>) {
        let mut config = HttpConfig::new(self.listen, token.clone());
        config.insecure = self.insecure;
        match HttpServer::bind(config, observer, Some(Arc::clone(&self.panel))) {
            Ok(server) => {
                crate::exit::say(announce(&server, token.as_deref(), !self.token_given));
                *self.handle.lock().unwrap_or_else(|e| e.into_inner()) = Some(server.spawn());
            }
            Err(error) => crate::exit::report(format_args!("{error}; going on without it")),
        }
    }

    fn launcher(&self, view: LauncherView) {
        self.panel.set_launcher(view);
    }

    fn stacks(&self, stacks: StacksView) {
        self.panel.set_stacks(stacks);
    }
}
