#!/usr/bin/env python3
"""Counts a crate's public items from rustdoc's JSON, as CHANGELOG.md's "public surface" counts.

Every item reachable from the crate root through public modules and `pub use` (followed to the
item, counted once however many paths reach it): modules (not the root), structs, enums, traits,
type aliases, constants, statics, free functions, and the functions and constants of inherent
impls. Not enum variants, struct fields, trait items or trait impls' items, and not items of
other crates (the re-exported `gradwire_core`).

Usage: cargo +nightly rustdoc -p gradwire --lib -- -Z unstable-options --output-format json
       tools/public_items.py target/doc/gradwire.json [--list] [--max N]
"""
import json
import sys

COUNTED = {"module", "struct", "enum", "trait", "type_alias", "constant", "static", "function"}


def main():
    args = sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    doc = json.load(open(args[0]))
    index = doc["index"]
    root = str(doc["root"])
    seen = {}

    def item(id_):
        return index.get(str(id_))

    def visit(id_, path):
        it = item(id_)
        if it is None or it.get("crate_id", 0) != 0:
            return  # another crate's item
        kind, inner = next(iter(it["inner"].items()))
        if kind == "use":
            if inner["id"] is None:
                return
            target = item(inner["id"])
            if inner["is_glob"] and target is not None:
                tkind, tinner = next(iter(target["inner"].items()))
                if tkind == "module":
                    for child in tinner["items"]:
                        c = item(child)
                        if c is not None and c["visibility"] == "public":
                            visit(child, path + [c.get("name") or "?"])
                return
            visit(inner["id"], path[:-1] + [inner["name"]])
            return
        key = str(id_)
        if key in seen:
            return
        if kind in COUNTED and key != root:
            seen[key] = "::".join(path) + f" ({kind})"
        if kind == "module":
            for child in inner["items"]:
                c = item(child)
                if c is not None and c["visibility"] == "public":
                    visit(child, path + [c.get("name") or "?"])
        if kind in ("struct", "enum", "union"):
            for impl_id in inner.get("impls", []):
                impl = item(impl_id)
                if impl is None:
                    continue
                i = impl["inner"]["impl"]
                if i["trait"] is not None or i.get("blanket_impl") is not None or i["is_synthetic"]:
                    continue
                for m in i["items"]:
                    mi = item(m)
                    if mi is None or mi["visibility"] != "public":
                        continue
                    mkind = next(iter(mi["inner"]))
                    if mkind in ("function", "assoc_const", "constant"):
                        mkey = str(m)
                        if mkey not in seen:
                            seen[mkey] = "::".join(path + [mi["name"]]) + f" ({mkind})"

    visit(root, [index[root]["name"]])
    if "--list" in args:
        for line in sorted(seen.values()):
            print(line)
    count = len(seen)
    print(f"{count} public items")
    if "--max" in args:
        limit = int(args[args.index("--max") + 1])
        if count > limit:
            sys.exit(f"{count} public items, more than the recorded {limit}: "
                     "make the new ones crate-private or raise the limit in .ci/run with a reason")


if __name__ == "__main__":
    main()
