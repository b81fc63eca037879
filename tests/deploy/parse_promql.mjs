// Parses PromQL expressions (a JSON array of strings on stdin) with Prometheus' own
// grammar, @prometheus-io/lezer-promql (ci/install_chart_tools.py installs it).
// argv[2]: that package's dist/index.es.js.  Prints one JSON array: null for an
// expression that parses, else the offset and text of its first syntax error.
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";

const { parser } = await import(pathToFileURL(process.argv[2]).href);
const results = JSON.parse(readFileSync(0, "utf8")).map((expr) => {
  let error = null;
  parser.parse(expr).iterate({
    enter: (node) => {
      if (node.type.isError && error === null) {
        error = `syntax error at ${node.from}: ${JSON.stringify(expr.slice(node.from, node.from + 30))}`;
      }
    },
  });
  return error;
});
console.log(JSON.stringify(results));
