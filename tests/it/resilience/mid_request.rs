//! Health that changes while a request is under way: retries stay in the
//! candidate set chosen for the request, so a gray request whose lane's
//! last healthy nodes fail mid-request gets an error or another gray node,
//! never formal; the fallback to formal is decided at choice time only.

use std::sync::Arc;

use tokio::sync::Notify;

use super::{fallbacks, get_lane, setup};
use crate::harness::*;

/// Retries to spare, active checks that mark a node down at its first
/// failed probe and up at its first good one, passive health that never
/// ejects: only the checks (which the test steers) change health.
const CHECKS: &str = "    retries: 3\n    health:\n      active: { path: /health, interval_ms: 30, timeout_ms: 500, healthy: 1, unhealthy: 1 }\n      passive: { max_fails: 1000 }\n";

async fn health_is(gw: &Gateway, node: &str, state: &str) -> bool {
    gw.node_doc(node).await["health"] == state
}

/// Sends a gray request in the background and waits until g1 or g2 holds
/// it; returns the request, the node holding it and the other one.
async fn held_gray_request<'a>(
    gw: &Gateway,
    g1: &'a Backend,
    g2: &'a Backend,
) -> (tokio::task::JoinHandle<Resp>, &'a Backend, &'a Backend) {
    let before = g1.arrived();
    let total = before + g2.arrived();
    let addr = gw.addr;
    let req = tokio::spawn(async move { Req::get("/x").header("X-Lane", "gray").send(addr).await });
    soon("the request reached a gray node", || async {
        g1.arrived() + g2.arrived() == total + 1
    })
    .await;
    if g1.arrived() > before {
        (req, g1, g2)
    } else {
        (req, g2, g1)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_never_leave_the_chosen_set_when_health_changes_mid_request() {
    let gate = Arc::new(Notify::new());
    let [f1, f2, g1, g2, v1] = full_backends([
        ("f1", "formal"),
        ("f2", "formal"),
        ("g1", "gray"),
        ("g2", "gray"),
        ("v1", "v2"),
    ])
    .await;
    g1.set_mode(Mode::HoldDrop(gate.clone()));
    g2.set_mode(Mode::HoldDrop(gate.clone()));
    let s = setup(CHECKS, &[&f1, &f2, &g1, &g2, &v1]);
    let others = || f1.arrived() + f2.arrived() + v1.arrived();

    // Both gray nodes healthy at choice time: the gray set is chosen, and
    // the request is held at one of them.
    let (req, held, other) = held_gray_request(&s.gw, &g1, &g2).await;
    // Meanwhile the checks mark both gray nodes down; then the held node
    // closes the connection unanswered (a retryable failure of a GET).
    g1.set_health(503);
    g2.set_health(503);
    soon("both gray nodes marked down", || async {
        health_is(&s.gw, "g1", "unhealthy").await && health_is(&s.gw, "g2", "unhealthy").await
    })
    .await;
    gate.notify_one();
    let r = req.await.unwrap();
    // No node of the chosen set is left: an error, not formal's answer.
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(others(), 0, "a retry left the request's candidate set");
    assert_eq!(other.arrived(), 0, "a retry went to a node marked down");
    assert_eq!(held.arrived(), 1);
    let fell_back = fallbacks(&s.gw, "gray", "lane_unhealthy").await;
    assert_eq!(fell_back.unwrap_or(0.0), 0.0, "chosen as a fallback");

    // A request chosen now, with no gray node healthy, falls back to
    // formal (its tag still gray).
    let r = get_lane(&s.gw, "gray").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(["f1", "f2"].contains(&r.node().as_str()), "{}", r.text());
    assert_eq!(r.json()["tag"], "gray");
    assert_eq!(fallbacks(&s.gw, "gray", "lane_unhealthy").await, Some(1.0));

    // Healthy again; only the node holding the next request goes down
    // mid-request: its retry takes the other gray node.
    g1.set_health(200);
    g2.set_health(200);
    soon("both gray nodes back up", || async {
        health_is(&s.gw, "g1", "healthy").await && health_is(&s.gw, "g2", "healthy").await
    })
    .await;
    let (req, held, other) = held_gray_request(&s.gw, &g1, &g2).await;
    other.set_mode(Mode::Full);
    held.set_health(503);
    soon("the held node marked down", || async {
        health_is(&s.gw, &held.name, "unhealthy").await
    })
    .await;
    gate.notify_one();
    let r = req.await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.node(), other.name);
    assert_eq!(r.json()["tag"], "gray");
    assert_eq!(
        others(),
        1,
        "only the request chosen while gray was down went formal"
    );
    assert_eq!(fallbacks(&s.gw, "gray", "lane_unhealthy").await, Some(1.0));
}
