//! Parsers for flag values that clap has no ready parser for. Their errors become
//! clap usage errors (exit code 2) that quote the bad value.

/// Seconds, 0 or more ("30", "0.5"); longer than a century, or `inf`, is a century
/// (forever, in practice: see [`rallypoint_client::env::LONGEST_WAIT_SECS`]).
pub fn secs(text: &str) -> Result<f64, String> {
    let secs: f64 = text.trim().parse().map_err(|_| format!("'{text}' is not a number of seconds"))?;
    match rallypoint_client::env::seconds(secs) {
        Some(wait) => Ok(wait.as_secs_f64()),
        None => Err(format!("'{text}' is not a duration: seconds must be 0 or more")),
    }
}

/// A coordinator address: HOST:PORT (`[v6]:PORT` for IPv6) or `unix:PATH`. Caught
/// here, at once: a connect would retry a malformed address until its timeout.
pub fn addr(text: &str) -> Result<String, String> {
    rallypoint_client::check_addr(text).map(|()| text.to_owned())
}

/// An address to listen on: IP:PORT (`[v6]:PORT`), port 0 for any free one. A host
/// name is refused by name: it may stand for several addresses, and which one a
/// server should bind is the user's choice.
pub fn listen(text: &str) -> Result<std::net::SocketAddr, String> {
    if let Ok(addr) = text.parse() {
        return Ok(addr);
    }
    let hint = "give an IP address and a port, e.g. 127.0.0.1:29500 (this host only) or 0.0.0.0:29500 (every \
                interface)";
    match text.rsplit_once(':') {
        Some((host, port)) if port.parse::<u16>().is_ok() && !host.is_empty() => {
            Err(format!("'{host}' is not an IP address: {hint}"))
        }
        Some((host, port)) if !host.is_empty() && !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => {
            Err(format!("'{port}' in '{text}' is not a port (0 to 65535; 0 for any free one)"))
        }
        _ => Err(format!("not IP:PORT: {hint}")),
    }
}

/// Most ranks a rank list may expand to (a typo like "0-4000000000" must not
/// allocate gigabytes).
const MAX_RANKS: u64 = 1 << 20;

/// Ranks named on the command line (a newtype: clap would take `Vec<u32>` as a
/// flag given many times).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankList(pub Vec<u32>);

/// A rank list: comma-separated ranks and inclusive ranges, e.g. "0,2,5" or "0-3,8".
pub fn ranks(text: &str) -> Result<RankList, String> {
    let mut ranks = Vec::new();
    for part in text.split(',') {
        let part = part.trim();
        if part.is_empty() {
            return Err(format!("empty entry in rank list '{text}'"));
        }
        match part.split_once('-') {
            Some((first, last)) => {
                let (first, last) = (rank(first, text)?, rank(last, text)?);
                if first > last {
                    return Err(format!("range '{part}' in rank list '{text}' runs backwards"));
                }
                if ranks.len() as u64 + u64::from(last - first) >= MAX_RANKS {
                    return Err(format!("rank list '{text}' has more than {MAX_RANKS} ranks"));
                }
                ranks.extend(first..=last);
            }
            None => ranks.push(rank(part, text)?),
        }
    }
    Ok(RankList(ranks))
}

fn rank(text: &str, list: &str) -> Result<u32, String> {
    text.trim().parse().map_err(|_| format!("'{text}' in rank list '{list}' is not a rank (a number from 0)"))
}

/// An incarnation: up to 16 hex digits, with or without `0x`.
pub fn incarnation(s: &str) -> Result<u64, String> {
    s.parse::<rallypoint_client::Incarnation>().map(|i| i.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_lists() {
        assert_eq!(ranks("0,2,5").unwrap().0, vec![0, 2, 5]);
        assert_eq!(ranks("0-3, 8").unwrap().0, vec![0, 1, 2, 3, 8]);
        assert!(ranks("0,x").unwrap_err().contains("'x'"));
        assert!(ranks("1,,2").unwrap_err().contains("empty"));
        assert!(ranks("-1").is_err());
        assert!(ranks("5-2").unwrap_err().contains("backwards"));
        assert!(ranks("0-4000000000").unwrap_err().contains("more than"));
    }

    #[test]
    fn listen_addresses() {
        assert_eq!(listen("127.0.0.1:0").map(|a| a.port()), Ok(0));
        assert!(listen("[::1]:29500").is_ok());
        let e = listen("localhost:0").unwrap_err();
        assert!(e.contains("'localhost' is not an IP address") && e.contains("127.0.0.1:29500"), "{e}");
        assert!(listen("127.0.0.1").unwrap_err().starts_with("not IP:PORT"));
        assert_eq!(
            listen("127.0.0.1:99999").unwrap_err(),
            "'99999' in '127.0.0.1:99999' is not a port (0 to 65535; 0 for any free one)"
        );
    }

    #[test]
    fn seconds() {
        assert_eq!(secs("0.5").unwrap(), 0.5);
        assert!(secs("-1").unwrap_err().contains("'-1'"));
        assert!(secs("nan").unwrap_err().contains("seconds must be 0 or more"));
        // Forever, in practice: a century, which a deadline can hold.
        let century = rallypoint_client::env::LONGEST_WAIT_SECS;
        assert_eq!((secs("inf").unwrap(), secs("1e300").unwrap()), (century, century));
        assert!(secs("soon").unwrap_err().contains("'soon'"));
    }
}
