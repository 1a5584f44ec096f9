//! The master's admin port as the CLI calls it (`drain`, `keys`, `lunakv bench --drain`): where it
//! is, the admin token of this environment, JSON calls and text listings over the one HTTP
//! client (lunakv-http).

use std::time::Duration;

use anyhow::Context as _;
use lunakv_proto::ErrorCode;

use crate::error::Coded;

/// One admin call's bound.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The admin port's base URL: `--admin` (HOST:PORT or a URL), else the master's host on 9003.
pub(crate) fn admin_base(admin: Option<&str>, master: &str) -> anyhow::Result<String> {
    if let Some(admin) = admin {
        return Ok(if admin.contains("://") {
            admin.trim_end_matches('/').to_string()
        } else {
            format!("http://{admin}")
        });
    }
    let host = master
        .rsplit_once(':')
        .map(|(h, _)| h)
        .filter(|h| !h.is_empty() && !master.contains("://"))
        .ok_or_else(|| {
            Coded::new(
                ErrorCode::InvalidParams,
                format!(
                    "cannot tell the master's admin port from {master:?}: give --admin \
                     HOST:PORT (the master's --metrics_port, 9003 by default)"
                ),
            )
        })?;
    Ok(format!("http://{host}:9003"))
}

/// The admin token (LUNAKV_ADMIN_TOKEN, else the pool's LUNAKV_AUTH_TOKEN), as the guarded
/// routes want it.
fn bearer() -> Option<String> {
    ["LUNAKV_ADMIN_TOKEN", "LUNAKV_AUTH_TOKEN"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|t| !t.is_empty()))
        .map(|t| format!("Bearer {t}"))
}

/// The master's admin port, as `drain`, `keys` and `lunakv bench --drain` use it.
pub(crate) struct Admin {
    base: String,
    rt: tokio::runtime::Runtime,
    http: lunakv_http::HttpClient,
    auth: Option<String>,
}

impl Admin {
    /// Calls to `base` (`http://host:port`), with the admin token of this environment.
    pub(crate) fn new(base: String) -> anyhow::Result<Admin> {
        Ok(Admin {
            base,
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("starting an I/O runtime")?,
            http: lunakv_http::HttpClient::from_env(CALL_TIMEOUT)?,
            auth: bearer(),
        })
    }

    /// A GET of a text listing (`/get_all_keys`); an HTTP error names the route and the answer.
    pub(crate) fn text(&self, path: &str) -> anyhow::Result<String> {
        let url = format!("{}{path}", self.base);
        let mut req = lunakv_http::request(lunakv_http::Method::GET, &url, Default::default())?;
        if let Some(a) = &self.auth {
            req.headers_mut()
                .insert("authorization", a.parse().context("the token")?);
        }
        let resp = self
            .rt
            .block_on(self.http.send(req, CALL_TIMEOUT))
            .map_err(|e| Coded::new(ErrorCode::RpcFail, e.to_string()))?;
        if !resp.status.is_success() {
            return Err(Coded::new(
                ErrorCode::RpcFail,
                format!("{url}: HTTP {}: {}", resp.status, resp.text().trim()),
            )
            .into());
        }
        Ok(resp.text())
    }

    /// One call; the answer's JSON, or the master's refusal as an error naming it.
    pub(crate) fn call(
        &self,
        method: &str,
        path: &str,
        body: &str,
    ) -> anyhow::Result<serde_json::Value> {
        let url = format!("{}{path}", self.base);
        let method: lunakv_http::Method = method.parse().context("method")?;
        let mut req = lunakv_http::request(method, &url, body.to_string().into())?;
        req.headers_mut().insert(
            "content-type",
            lunakv_http::HeaderValue::from_static("application/json"),
        );
        if let Some(a) = &self.auth {
            req.headers_mut()
                .insert("authorization", a.parse().context("the token")?);
        }
        let resp = self
            .rt
            .block_on(self.http.send(req, CALL_TIMEOUT))
            .map_err(|e| Coded::new(ErrorCode::RpcFail, e.to_string()))?;
        let v: serde_json::Value = serde_json::from_slice(&resp.body).map_err(|_| {
            Coded::new(
                ErrorCode::RpcFail,
                format!(
                    "{url} answered HTTP {} with no JSON: {} (an older master without drain \
                     jobs?)",
                    resp.status,
                    resp.text()
                ),
            )
        })?;
        if !resp.status.is_success() || v["success"] != true {
            let code = v["error_code"].as_i64().unwrap_or(-1) as i32;
            let msg = v["error_message"]
                .as_str()
                .or(v["error"].as_str())
                .unwrap_or("no message");
            return Err(Coded::new(
                ErrorCode::from_i32(code),
                format!("{url}: HTTP {}: {msg}", resp.status),
            )
            .into());
        }
        Ok(v)
    }
}
