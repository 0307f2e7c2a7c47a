//! Rule management through the admin API: the `enabled` switch and a rule's
//! percentage, written back to the rule file and applied by a reload.

use std::net::SocketAddr;

use crate::harness::*;

const RULES: &str = "# team rules\nenabled: true\nuid: { header: X-User-Id }\nrules:\n  - name: staff\n    lane: gray\n    header: { name: X-Staff, values: [\"1\"] }\n  - name: canary\n    lane: gray\n    percentage: 0\n";

fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

async fn patch(admin: SocketAddr, path: &str, body: &str) -> Resp {
    Req::get(path)
        .method("PATCH")
        .body(body.to_string())
        .send(admin)
        .await
}

async fn user(gw: &Gateway, uid: usize) -> Resp {
    Req::get("/api/x")
        .header("X-User-Id", &format!("u{uid}"))
        .send(gw.addr)
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rule_percentage_and_switch_are_written_back_and_applied() {
    let [f1, g1] = backends([("f1", "formal"), ("g1", "gray")]).await;
    let fx = Fixture::new();
    fx.write("rules.yaml", RULES);
    fx.api_nodes(&[&f1, &g1]);
    let gw = Config::new()
        .rules_file("rules.yaml")
        .raw("access_log: { path: access.log, format: json }\n")
        .node_files(&["nodes.yaml"])
        .routes(&[Route::service("/api/", "api")])
        .start(&fx, "gg.yaml");
    let admin = gw.admin.unwrap();
    let rules_file = || std::fs::read_to_string(fx.path("rules.yaml")).unwrap();
    let gray_matched = |m: &str| {
        sample(
            m,
            "graygate_decisions_total{decided_by=\"rule\",lane=\"gray\",rule=\"canary\"}",
        )
        .unwrap_or(0.0)
    };

    let doc = Req::get("/rules").send(admin).await.json();
    assert_eq!(doc["source"], "file");
    assert_eq!(doc["enabled"], true);
    assert_eq!(doc["rules"][1]["name"], "canary");
    assert_eq!(doc["rules"][1]["percentage"], 0.0);
    for u in 0..20 {
        assert_eq!(user(&gw, u).await.node(), "f1");
    }

    // 0 → 100 %: every user goes gray, and the gray-matched counter proves it.
    let r = patch(admin, "/rules/canary", r#"{"percentage": 100}"#).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let on_disk: serde_yaml::Value = serde_yaml::from_str(&rules_file()).unwrap();
    assert_eq!(on_disk["rules"][1]["percentage"].as_u64(), Some(100));
    assert_eq!(
        on_disk["rules"][0]["header"]["name"].as_str(),
        Some("X-Staff")
    );
    assert_eq!(
        Req::get("/rules").send(admin).await.json()["rules"][1]["percentage"],
        100.0
    );
    let m = gw.metrics().await;
    assert_eq!(gray_matched(&m), 0.0);
    for u in 0..20 {
        assert_eq!(user(&gw, u).await.node(), "g1");
    }
    let m = gw.metrics().await;
    assert_eq!(gray_matched(&m), 20.0, "{m}");
    // The access log names the deciding rule.
    let log = fx.path("access.log");
    eventually(
        "40 access log lines",
        std::time::Duration::from_secs(10),
        || async { std::fs::read_to_string(&log).is_ok_and(|t| t.lines().count() == 40) },
    )
    .await;
    let text = std::fs::read_to_string(&log).unwrap();
    let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(
        (last["decided_by"].clone(), last["rule"].clone()),
        ("rule".into(), "canary".into())
    );
    let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(first["decided_by"], "rule_fallback");
    assert!(first["rule"].is_null());
    let e = Req::get("/explain?path=/api/x&header=X-User-Id:%20u7")
        .send(admin)
        .await
        .json();
    assert_eq!(
        (e["decided_by"].clone(), e["rule"].clone()),
        ("rule".into(), "canary".into())
    );
    assert_eq!(e["chosen"], "g1");

    // The master switch.
    let r = patch(admin, "/rules", r#"{"enabled": false}"#).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(rules_file().contains("enabled: false"));
    let r = Req::get("/api/x")
        .header("X-Staff", "1")
        .send(gw.addr)
        .await;
    assert_eq!(r.node(), "f1", "rules are off");
    assert_eq!(user(&gw, 3).await.node(), "f1");

    // Refused changes: nothing written.
    let before = rules_file();
    for (path, body, want) in [
        ("/rules/canary", r#"{"percentage": 150}"#, 400),
        ("/rules/canary", r#"{"percentage": -1}"#, 400),
        ("/rules/canary", r#"{"percent": 5}"#, 400),
        ("/rules", r#"{"enabled": "yes"}"#, 400),
        ("/rules", "not json", 400),
        ("/rules/nosuch", r#"{"percentage": 5}"#, 404),
    ] {
        let r = patch(admin, path, body).await;
        assert_eq!(r.status, want, "{path} {body}: {}", r.text());
    }
    assert_eq!(rules_file(), before);
    assert_eq!(
        Req::get("/rules").method("DELETE").send(admin).await.status,
        405
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_rules_are_shown_but_not_rewritten() {
    let f1 = Backend::start("f1", "formal").await;
    let fx = Fixture::new();
    fx.api_nodes(&[&f1]);
    let cfg = Config::new().raw("rules:\n  rules:\n    - { name: staff, lane: gray, header: { name: X-Staff, values: [\"1\"] } }\n").node_files(&["nodes.yaml"]).routes(&[Route::service("/api/", "api")]).write(&fx, "gg.yaml");
    let gw = Gateway::start(&cfg);
    let admin = gw.admin.unwrap();
    let doc = Req::get("/rules").send(admin).await.json();
    assert_eq!(doc["source"], "inline");
    assert_eq!(doc["rules"][0]["name"], "staff");
    let before = std::fs::read_to_string(&cfg).unwrap();
    let r = patch(admin, "/rules", r#"{"enabled": false}"#).await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(r.text().contains("rules_file"));
    assert_eq!(std::fs::read_to_string(&cfg).unwrap(), before);
}
