//! Host and address spelling shared by the commands: IPv6 literals are bracketed wherever a port
//! or a URL follows them.

/// `host` as it appears before `:port` or in a URL (`::1` → `[::1]`).
pub fn url_host(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_owned()
    }
}

/// `host:port`, bindable and connectable for names, IPv4 and IPv6 literals alike.
pub fn socket_addr(host: &str, port: u16) -> String {
    format!("{}:{port}", url_host(host))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv6_literals_are_bracketed_once() {
        assert_eq!(socket_addr("127.0.0.1", 80), "127.0.0.1:80");
        assert_eq!(socket_addr("::", 80), "[::]:80");
        assert_eq!(socket_addr("[::1]", 80), "[::1]:80");
        assert_eq!(url_host("node7"), "node7");
    }
}
