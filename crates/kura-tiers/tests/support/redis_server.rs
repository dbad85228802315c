//! A real `redis-server` for tests ($KURA_REDIS_SERVER, else `redis-server` on PATH;
//! scripts/fetch-redis.sh installs one): started on a free port, in memory only, killed on drop. A
//! missing `redis-server` fails the test that asks for one. Shared by the Redis tier's tests and the
//! engine's (`#[path]`).

#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn redis_server_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("KURA_REDIS_SERVER") {
        return PathBuf::from(p);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("redis-server"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "no redis-server on PATH: run scripts/fetch-redis.sh (scripts/test.sh does) or set \
                 KURA_REDIS_SERVER"
            )
        })
}

/// One `redis-server` on a free port, in memory only, killed on drop.
pub struct Redis {
    child: Child,
    pub url: String,
    dir: PathBuf,
}

/// A port no one listens on now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Redis {
    pub fn start() -> Self {
        Self::start_on(free_port())
    }

    /// A server on `port` (one stopped earlier, started again).
    pub fn start_on(port: u16) -> Self {
        let dir =
            std::env::temp_dir().join(format!("kura-tiers-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let child = Command::new(redis_server_bin())
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
            ])
            .args(["--appendonly", "no", "--dir"])
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting redis-server");
        let r = Redis {
            child,
            url: format!("redis://127.0.0.1:{port}"),
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(mut c) = redis::Client::open(r.url.as_str()).and_then(|c| c.get_connection())
            {
                if redis::cmd("PING").query::<String>(&mut c).is_ok() {
                    return r;
                }
            }
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn conn(&self) -> redis::Connection {
        redis::Client::open(self.url.as_str())
            .unwrap()
            .get_connection()
            .unwrap()
    }

    pub fn get(&self, key: &str) -> Option<Vec<u8>> {
        redis::cmd("GET").arg(key).query(&mut self.conn()).unwrap()
    }

    pub fn set(&self, key: &str, value: &[u8]) {
        redis::cmd("SET")
            .arg(key)
            .arg(value)
            .query::<()>(&mut self.conn())
            .unwrap();
    }

    /// Keys in Redis now (`DBSIZE`).
    pub fn keys(&self) -> u64 {
        redis::cmd("DBSIZE").query(&mut self.conn()).unwrap()
    }

    pub fn exists(&self, key: &str) -> bool {
        redis::cmd("EXISTS")
            .arg(key)
            .query::<u64>(&mut self.conn())
            .unwrap()
            == 1
    }

    /// Calls of `command` Redis has run so far (`INFO commandstats`).
    pub fn calls(&self, command: &str) -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut self.conn())
            .unwrap();
        let prefix = format!("cmdstat_{command}:calls=");
        info.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .map_or(0, |rest| {
                rest.split(',').next().unwrap_or("0").parse().unwrap()
            })
    }

    /// Bytes Redis has sent to its clients so far.
    pub fn net_output_bytes(&self) -> u64 {
        self.stat("total_net_output_bytes")
    }

    /// Connections Redis has accepted so far (each of this helper's own calls opens one).
    pub fn connections_received(&self) -> u64 {
        self.stat("total_connections_received")
    }

    fn stat(&self, name: &str) -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("stats")
            .query(&mut self.conn())
            .unwrap();
        let prefix = format!("{name}:");
        info.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .unwrap_or_else(|| panic!("INFO stats has {name}"))
            .trim()
            .parse()
            .unwrap()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
