//! Network interfaces by name: the host's list (getifaddrs), the rules by
//! which an interface variable picks one, and the interface a rank uses
//! towards other hosts when the route to the rendezvous stays on this one.

use std::ffi::CStr;
use std::net::Ipv4Addr;

use super::NCCL_SOCKET_IFNAME;
use crate::error::{Error, Result};

/// One network interface of this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    /// Its name (`lo`, `eth0`, ...).
    pub name: String,
    /// Its first IPv4 address, if it has one.
    pub ipv4: Option<Ipv4Addr>,
    /// The length of that address's network prefix (24 for a /24), if known.
    pub prefix_len: Option<u8>,
}

impl Interface {
    /// An interface named `name` with `ipv4` (prefix unknown).
    pub fn new(name: &str, ipv4: Option<Ipv4Addr>) -> Self {
        Interface {
            name: name.to_string(),
            ipv4,
            prefix_len: None,
        }
    }
}

/// Name prefixes of interfaces that do not lead to other hosts: container
/// and VM bridges (NCCL skips `docker` by default for the same reason).
const LOCAL_BRIDGES: [&str; 3] = ["docker", "virbr", "br-"];

/// The interface a rank reaches other hosts through when nothing names one
/// and the route to the rendezvous host stays on this host (its name maps
/// to a loopback address, as stock Debian's `/etc/hosts` does with
/// `127.0.1.1`): the first interface in the system's order with an IPv4
/// address that is not loopback and not a local bridge. `None` when the
/// host has no such interface.
pub fn outward_interface(interfaces: &[Interface]) -> Option<&Interface> {
    interfaces.iter().find(|i| {
        i.ipv4
            .is_some_and(|ip| !ip.is_loopback() && !ip.is_unspecified())
            && !LOCAL_BRIDGES.iter().any(|p| i.name.starts_with(p))
    })
}

/// This host's interfaces in the system's order, each once, with its first
/// IPv4 address.
pub fn system_interfaces() -> Result<Vec<Interface>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(Error::io(
            "getifaddrs (the list of network interfaces)",
            std::io::Error::last_os_error(),
        ));
    }
    let mut out: Vec<Interface> = Vec::new();
    let mut entry = head;
    while !entry.is_null() {
        // SAFETY: `entry` is a node of the list getifaddrs returned, alive
        // until freeifaddrs; its name is a NUL-terminated string and its
        // address and netmask, when not null, are sockaddr_in when the
        // address's family is AF_INET.
        let (name, ipv4, prefix_len, next) = unsafe {
            let e = &*entry;
            let name = CStr::from_ptr(e.ifa_name).to_string_lossy().into_owned();
            let addr = e.ifa_addr;
            let (ipv4, prefix_len) =
                if !addr.is_null() && i32::from((*addr).sa_family) == libc::AF_INET {
                    let sin = &*(addr as *const libc::sockaddr_in);
                    let mask = e.ifa_netmask;
                    let prefix = if mask.is_null() {
                        None
                    } else {
                        let m = &*(mask as *const libc::sockaddr_in);
                        Some(u32::from_be(m.sin_addr.s_addr).leading_ones() as u8)
                    };
                    (
                        Some(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))),
                        prefix,
                    )
                } else {
                    (None, None)
                };
            (name, ipv4, prefix_len, e.ifa_next)
        };
        match out.iter_mut().find(|i| i.name == name) {
            Some(known) if known.ipv4.is_none() && ipv4.is_some() => {
                known.ipv4 = ipv4;
                known.prefix_len = prefix_len;
            }
            Some(_) => {}
            None => out.push(Interface {
                name,
                ipv4,
                prefix_len,
            }),
        }
        entry = next;
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// The IPv4 address `variable=value` picks among `interfaces`: for
/// `NCCL_SOCKET_IFNAME` NCCL's rule (a comma-separated list of name
/// prefixes; `=` first: exact names; `^` first: every interface but
/// those; the first interface in the system's order that matches and has
/// an IPv4 address), for the others the first name of a comma-separated
/// list, exactly. No match is an `Error::Config` listing the interfaces.
pub(super) fn resolve(variable: &str, value: &str, interfaces: &[Interface]) -> Result<Ipv4Addr> {
    let found = if variable == NCCL_SOCKET_IFNAME {
        let (exclude, rest) = match value.strip_prefix('^') {
            Some(rest) => (true, rest),
            None => (false, value),
        };
        let (exact, rest) = match rest.strip_prefix('=') {
            Some(rest) => (true, rest),
            None => (false, rest),
        };
        let entries: Vec<&str> = rest
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .collect();
        let matches = |name: &str| {
            entries.iter().any(|e| {
                if exact {
                    name == *e
                } else {
                    name.starts_with(e)
                }
            })
        };
        interfaces
            .iter()
            .filter(|i| matches(&i.name) != exclude)
            .find_map(|i| i.ipv4)
    } else {
        let name = value.split(',').next().unwrap_or("").trim();
        interfaces
            .iter()
            .find(|i| i.name == name)
            .and_then(|i| i.ipv4)
    };
    found.ok_or_else(|| {
        let listed: Vec<String> = interfaces
            .iter()
            .map(|i| match i.ipv4 {
                Some(ip) => format!("{} ({ip})", i.name),
                None => format!("{} (no IPv4)", i.name),
            })
            .collect();
        Error::Config {
            variable: variable.to_string(),
            value: value.to_string(),
            expected: format!(
                "a network interface of this host with an IPv4 address; it has {}",
                listed.join(", ")
            ),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_prefix(name: &str, ip: Ipv4Addr, len: u8) -> Interface {
        Interface {
            prefix_len: Some(len),
            ..Interface::new(name, Some(ip))
        }
    }

    #[test]
    fn outward_skips_loopback_bridges_and_interfaces_without_ipv4() {
        let interfaces = [
            with_prefix("lo", Ipv4Addr::LOCALHOST, 8),
            Interface::new("ib0", None),
            with_prefix("docker0", Ipv4Addr::new(172, 17, 0, 1), 16),
            with_prefix("ensb1", Ipv4Addr::new(10, 0, 0, 2), 24),
            with_prefix("eth1", Ipv4Addr::new(10, 1, 0, 2), 24),
        ];
        assert_eq!(
            outward_interface(&interfaces).map(|i| i.name.as_str()),
            Some("ensb1")
        );
        assert_eq!(outward_interface(&interfaces[..3]), None);
    }

    #[test]
    fn the_system_list_has_prefixes_for_ipv4_interfaces() {
        let interfaces = system_interfaces().expect("getifaddrs");
        for i in interfaces.iter().filter(|i| i.ipv4.is_some()) {
            assert!(i.prefix_len.is_some_and(|l| l <= 32), "{i:?}");
        }
    }
}
