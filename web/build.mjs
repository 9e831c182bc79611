// Builds the chat page into mlxinfer/server/static/ (the files the Python package serves).
// `npm ci && npm run build` reproduces the committed files exactly.
import { build } from "esbuild";
import { copyFileSync, mkdirSync, rmSync } from "node:fs";

const out = "../mlxinfer/server/static";
rmSync(out, { recursive: true, force: true });
mkdirSync(out, { recursive: true });

await build({
  entryPoints: ["src/chat.js"],
  bundle: true,
  minify: true,
  format: "iife",
  target: ["chrome110", "safari16", "firefox110"],
  outdir: out,
  loader: { ".woff2": "file" },
  assetNames: "fonts/[name]",
  // KaTeX's stylesheet lists each font as woff2, then woff, then ttf; every browser the page
  // targets takes the woff2, so the two fallbacks are left out of the package (about 800 kB).
  external: ["*.woff", "*.ttf"],
  legalComments: "linked",
  logLevel: "warning",
});
copyFileSync("src/index.html", `${out}/index.html`);
