// Validates prometheus-operator objects (a JSON array on stdin) against the CRD's
// schema, with @kubernetes-models/prometheus-operator.
// argv[2]: that package's monitoring.coreos.com/v1/<Kind>.js (ServiceMonitor.js,
// PrometheusRule.js; ci/install_chart_tools.py installs it).  Prints one JSON array:
// null for a valid object, the validator's message for an invalid one.
import { readFileSync } from "node:fs";
import { basename } from "node:path";
import { pathToFileURL } from "node:url";

const kind = basename(process.argv[2], ".js");
const Model = (await import(pathToFileURL(process.argv[2]).href))[kind];
const results = JSON.parse(readFileSync(0, "utf8")).map((doc) => {
  try {
    new Model(doc).validate();
    return null;
  } catch (err) {
    return String(err.message || err);
  }
});
console.log(JSON.stringify(results));
