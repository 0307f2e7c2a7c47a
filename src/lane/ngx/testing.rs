//! Layer: lane (tests). Running a lane function through real Lua for the
//! `ngx` modules' tests: a request builder, the standard request, and
//! `run_with` / `eval`.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use crate::lane::script::testing::jit;
use crate::lane::script::{call_lane, RuleCtx, ScriptError, ScriptSource};
use crate::lane::shared_dict::SharedDict;
use crate::lane::RequestInfo;

pub(crate) fn request(uri: &str, ip: &str, headers: &[(&str, &str)]) -> RequestInfo {
    let mut b = http::Request::builder().method("POST").uri(uri);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let (parts, _) = b.body(()).unwrap().into_parts();
    RequestInfo {
        parts,
        client_ip: ip.parse::<IpAddr>().unwrap(),
        host: "shop.example".into(),
        peer_trusted: false,
    }
}

/// Runs `body` as the lane function on `req`; returns its string result.
pub(crate) fn run_with(
    body: &str,
    req: RequestInfo,
    dicts: BTreeMap<String, Arc<SharedDict>>,
) -> (RequestInfo, Result<Option<String>, ScriptError>) {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("t.lua");
    std::fs::write(&p, format!("return function(req)\n{body}\nend\n")).unwrap();
    let mut src = ScriptSource::load(&p).unwrap();
    src.dicts = dicts;
    src.jit = jit();
    call_lane(&src, &Arc::new(BTreeMap::new()), req, RuleCtx::default())
}

pub(crate) fn eval(body: &str, req: RequestInfo) -> String {
    let (_, r) = run_with(body, req, BTreeMap::new());
    r.unwrap_or_else(|e| panic!("{body}: {e}"))
        .unwrap_or_else(|| "<nil>".into())
}

pub(crate) fn std_req() -> RequestInfo {
    request(
        "/a//b/../c%20d?Name=J%20o&name=x&flag&uid=42",
        "10.1.2.3",
        &[
            ("X-User-Id", "u-7"),
            ("Cookie", "sid=abc; Ver=\"v2\""),
            ("Accept", "a"),
            ("accept", "b"),
        ],
    )
}
