"""What a response_format or tool JSON Schema is held to before any grammar is compiled (proxy and decoder).

Compile cost: llguidance checks every pair of one object's `patternProperties` regexes for overlap (each pair
within the library's own fuel, but the pairs and the regex builder they share grow with the square of the keys)
and builds a lexer over every regex. Measured on the demo tokenizer, 2 shared cores: keys of the form
`^t{i}(a|b)*c$` in one object compile in 3 ms at 32, 0.25 s at 128, 2 s at 200, 6 s at 300; 16 keys of the
costliest regexes found (overlap checks near their fuel) 0.09 s, 4 objects of them 0.34 s. The 64 KiB size cap
does not bound that; these counts do. Nesting is bounded too (an iterative walk, so no Python recursion limit
is reached on a deep schema; the library itself refuses JSON deeper than 128).

Unsatisfiable: a schema no finite document matches (a `$ref` that requires itself: a required property, or the
`minItems` items, of its own type, with no way out) compiles, but its output can never end; `unsatisfiable`
finds it by the least fixpoint over the `$ref`s: which references admit some finite document.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

MAX_SCHEMA_DEPTH = 100  # nested JSON objects and arrays in one schema (the library refuses past 128)
MAX_PATTERN_PROPERTIES = 16  # regex keys of one object's patternProperties (checked pairwise by the library)
MAX_SCHEMA_REGEXES = 64  # `pattern` values and patternProperties keys in one schema, all objects together
MAX_REGEX_CHARS = 1000  # one `pattern` or patternProperties key
# keyword -> how its value holds subschemas: "one" schema, a "list" of them, or a "map" of name -> schema
SUBSCHEMAS = {"properties": "map", "patternProperties": "map", "$defs": "map", "definitions": "map",
              "dependentSchemas": "map", "items": "one", "additionalProperties": "one", "propertyNames": "one",
              "additionalItems": "one", "not": "one", "if": "one", "then": "one", "else": "one", "contains": "one",
              "prefixItems": "list", "anyOf": "list", "oneOf": "list", "allOf": "list"}
_SCALARS = ("string", "number", "integer", "boolean", "null")


def subschemas(node: dict[str, Any], shapes: dict[str, str] = SUBSCHEMAS) -> Iterator[Any]:
    """The schemas directly inside `node` (its keywords' values that are schemas, not data like `const`)."""
    for key, shape in shapes.items():
        value = node.get(key)
        if shape == "map":
            yield from (value.values() if isinstance(value, dict) else ())
        elif shape == "list":
            yield from (value if isinstance(value, list) else ())
        elif key == "items" and isinstance(value, list):  # draft 4-2019's tuple form
            yield from value
        elif value is not None:
            yield value


def schema_cost_error(schema: Any) -> str | None:
    """Why compiling `schema` would cost more than the bounds above allow, or None."""
    if (deep := _too_deep(schema)) is not None:
        return deep
    num_regexes, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        keys = node.get("patternProperties")
        keys = list(keys) if isinstance(keys, dict) else []
        if len(keys) > MAX_PATTERN_PROPERTIES:
            return (f"an object has {len(keys)} patternProperties; at most {MAX_PATTERN_PROPERTIES} are compiled "
                    "(their regexes are checked pairwise)")
        regexes = keys + ([node["pattern"]] if isinstance(node.get("pattern"), str) else [])
        if (long := next((r for r in regexes if len(r) > MAX_REGEX_CHARS), None)) is not None:
            return f"a regex has {len(long)} characters; the maximum is {MAX_REGEX_CHARS}"
        num_regexes += len(regexes)
        if num_regexes > MAX_SCHEMA_REGEXES:
            return f"the schema has more than {MAX_SCHEMA_REGEXES} regexes (pattern and patternProperties keys)"
        stack.extend(subschemas(node))
    return None


def _too_deep(value: Any) -> str | None:
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)) and depth > MAX_SCHEMA_DEPTH:
            return f"the schema nests objects and arrays deeper than {MAX_SCHEMA_DEPTH} levels"
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return None


def unsatisfiable(schema: Any) -> str | None:
    """Why no finite JSON document can match `schema` (a `$ref` that requires itself), or None. Only references
    are followed; a schema the library finds unsatisfiable on its own (`required` of a `false`) is left to it."""
    refs = _refs(schema)
    finite: set[str] = set()  # references known to admit a finite document
    changed = True
    while changed:  # least fixpoint: at most one pass per reference
        changed = False
        for ref in refs.keys() - finite:
            target = refs[ref]
            if target is None or _finite(target, finite):
                finite.add(ref)
                changed = True
    loop = sorted(refs.keys() - finite)
    if not loop or _finite(schema, finite):  # no reference loops: whatever else is wrong, the library says
        return None
    return (f"no finite JSON document matches the schema: {', '.join(loop[:3])} requires itself (a required "
            "property or minItems of its own type, with no alternative that ends)")


def _refs(schema: Any) -> dict[str, Any]:
    """Every `$ref` in the schema -> its target (None: not a local JSON pointer this walk resolves)."""
    found: dict[str, Any] = {}
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in found:
            found[ref] = _resolve(schema, ref)
        stack.extend(subschemas(node))
    return found


def _resolve(schema: Any, ref: str) -> Any:
    if not ref.startswith("#"):
        return None
    node = schema
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _finite(node: Any, finite: set[str]) -> bool:
    """Some finite document matches `node`, given which references do; True where unsure (never a false refusal).
    It recurses into allOf/anyOf/required/items only, never through a $ref: bounded by the schema's depth."""
    if not isinstance(node, dict):
        return node is not False
    if isinstance(node.get("$ref"), str) and node["$ref"] not in finite:
        return False
    if isinstance(node.get("allOf"), list) and not all(_finite(s, finite) for s in node["allOf"]):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and not any(_finite(s, finite) for s in node[key]):
            return False
    if "const" in node or "enum" in node:
        return True
    types = node.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else {"object", "array",
                                                                                               *_SCALARS}
    return bool(types & set(_SCALARS)) or ("object" in types and _finite_object(node, finite)) or (
        "array" in types and _finite_array(node, finite))


def _finite_object(node: dict[str, Any], finite: set[str]) -> bool:
    props, required = _of(node, "properties", dict), _of(node, "required", list)
    extra = True if node.get("patternProperties") else node.get("additionalProperties", True)  # a pattern may match
    return all(_finite(props.get(name, extra) if isinstance(name, str) else True, finite) for name in required)


def _finite_array(node: dict[str, Any], finite: set[str]) -> bool:
    low, prefix, items = node.get("minItems", 0), _of(node, "prefixItems", list), node.get("items", True)
    if not isinstance(low, int) or low <= 0:
        return True
    return all(_finite(prefix[i] if i < len(prefix) else items, finite) for i in range(min(low, len(prefix) + 1)))


def _of(node: dict[str, Any], key: str, kind: type[Any]) -> Any:
    """node[key] if it is a `kind` (dict or list), else an empty one."""
    value = node.get(key)
    return value if isinstance(value, kind) else kind()
