// Fails when src/generated/ is not what scripts/generate.mjs makes from schemas/ now:
// regenerates into a temporary directory and compares every file byte for byte.
import { mkdtemp, readdir, readFile, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { generate } from "./generate.mjs";

const here = path.dirname(fileURLToPath(import.meta.url));
const committed = path.resolve(here, "../src/generated");
const fresh = await mkdtemp(path.join(tmpdir(), "stemq-ts-generated-"));
try {
  await generate(fresh);
  const names = new Set([...(await readdir(committed)), ...(await readdir(fresh))]);
  const drift = [];
  for (const name of [...names].sort()) {
    const [a, b] = await Promise.all(
      [committed, fresh].map((d) => readFile(path.join(d, name), "utf8").catch(() => null)),
    );
    if (a === null) drift.push(`${name}: missing from src/generated/`);
    else if (b === null) drift.push(`${name}: not generated any more`);
    else if (a !== b) {
      const al = a.split("\n");
      const bl = b.split("\n");
      const i = al.findIndex((line, n) => line !== bl[n]);
      const at = i === -1 ? Math.min(al.length, bl.length) : i;
      drift.push(`${name}: differs from line ${at + 1}:\n  committed: ${al[at] ?? "<end>"}\n  generated: ${bl[at] ?? "<end>"}`);
    }
  }
  if (drift.length) {
    console.error(`drift: src/generated/ is stale against schemas/ (run \`npm run generate\`):\n${drift.join("\n")}`);
    process.exit(1);
  }
  console.log(`no drift: src/generated/ matches schemas/ (${names.size} files)`);
} finally {
  await rm(fresh, { recursive: true, force: true });
}
