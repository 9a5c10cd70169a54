// Validates an AsyncAPI document with @asyncapi/parser (pinned in package.json): the
// parser and rule set `asyncapi validate` (@asyncapi/cli) runs, without the CLI's other
// commands. Fails on any error, as the CLI does by default; prints warnings.
// Usage: node validate.mjs FILE
import { readFileSync } from "node:fs";
import { Parser } from "@asyncapi/parser";

const file = process.argv[2];
if (!file) {
  console.error("usage: node validate.mjs FILE");
  process.exit(2);
}
const { document, diagnostics } = await new Parser().parse(readFileSync(file, "utf8"), { source: file });
const severity = ["error", "warning", "info", "hint"];
for (const d of diagnostics) {
  if (d.severity <= 1) {
    console.log(`${severity[d.severity]} ${d.code} at ${d.path.join("/")}: ${d.message}`);
  }
}
const errors = diagnostics.filter((d) => d.severity === 0).length;
if (errors > 0 || !document) {
  console.error(`${file}: ${errors} error(s): not a valid AsyncAPI document`);
  process.exit(1);
}
console.log(`${file}: valid AsyncAPI ${document.version()} (${document.channels().length} channels, ${document.operations().length} operations)`);
