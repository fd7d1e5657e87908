/**
 * Two statements of one transaction, written to the server at once, the first answered before the second
 * runs: Parse/Bind/Describe/Execute of the first, Flush, the same of the second, then Sync. PostgreSQL runs
 * the messages up to a Sync as one implicit transaction and sends what it has at the Flush, so the first
 * statement's rows arrive while the second is still running, and the second still sees, and keeps, what the
 * first left (its transaction-level locks).
 *
 * node-postgres sends a query object's messages itself when it is an instance of its `Query` (in pipeline
 * mode it refuses any other), so this is one. The rows are the lock statement's (`BatchRow`: two integers and
 * a text), decoded here from the text format without node-postgres's type parsers.
 */
import pg from "pg";
import type { QueryConfig } from "pg";
import type { BatchRow } from "./batch.js";

/** What of node-postgres's `Connection` this uses: its message writers and its record of named statements. */
interface Wire {
  stream: { cork?(): void; uncork?(): void };
  parsedStatements: Record<string, string>;
  submittedNamedStatements: Record<string, string>;
  parse(config: { text: string; name: string }): void;
  bind(config: {
    portal: string;
    statement: string;
    values: unknown[];
    valueMapper(value: unknown): string | null;
  }): void;
  describe(config: { type: "P"; name: string }): void;
  execute(config: { portal: string }): void;
  flush(): void;
  sync(): void;
  on(event: "parseComplete", listener: () => void): void;
  removeListener(event: "parseComplete", listener: () => void): void;
}

/** A named statement: the two parts are always prepared (once per connection). */
export type NamedQuery = QueryConfig & { name: string };

/** How a two-part statement ended: `error` null when both parts ran; `firstAnswered`, whether the first did. */
export interface TwoPartEnd {
  error: Error | null;
  firstAnswered: boolean;
  /** The second part's rows (empty after an error). */
  rows: BatchRow[];
}

/**
 * A parameter as PostgreSQL's text format has it: an array as an array literal of its elements (quoted), a
 * number or boolean as its text.
 */
function textValue(value: unknown): string | null {
  if (value === null || value === undefined) return null;
  if (Array.isArray(value)) {
    const items = value.map((item) =>
      item === null || item === undefined
        ? "NULL"
        : `"${String(item).replaceAll("\\", "\\\\").replaceAll('"', '\\"')}"`,
    );
    return `{${items.join(",")}}`;
  }
  return String(value);
}

const QueryBase = pg.Query as unknown as new (config: QueryConfig) => object;

export class TwoPartQuery extends QueryBase {
  /** Each part's rows. (Not `rows`: node-postgres reads that as the paging option, refused in pipeline mode.) */
  private readonly answers: [BatchRow[], BatchRow[]] = [[], []];
  private firstAnswered = false;
  /** Whether the second part's Parse was sent, and answered (ParseComplete after the first part's end). */
  private secondParse: { wire: Wire; done: boolean; listener: () => void } | null = null;
  private ended = false;

  constructor(
    private readonly first: NamedQuery,
    readonly second: NamedQuery,
    /** The first part's rows, as soon as they are in (the second part is still running). */
    private readonly onFirst: (rows: BatchRow[]) => void,
    private readonly onEnd: (end: TwoPartEnd) => void,
  ) {
    // (node-postgres keeps the first part's name as the query's: its record of parsed statements follows it)
    super({ name: first.name, text: first.text });
  }

  /** Called by node-postgres when the query goes on the wire. */
  submit(connection: unknown): Error | null {
    const wire = connection as Wire;
    const parsed = (name: string) =>
      wire.parsedStatements[name] !== undefined ||
      wire.submittedNamedStatements[name] !== undefined;
    wire.stream.cork?.();
    try {
      this.send(wire, this.first, parsed(this.first.name));
      wire.flush();
      const secondParsed = parsed(this.second.name);
      if (!secondParsed) {
        const listener = () => {
          if (this.firstAnswered && this.secondParse) this.secondParse.done = true;
        };
        this.secondParse = { wire, done: false, listener };
        wire.on("parseComplete", listener);
      }
      this.send(wire, this.second, secondParsed);
      wire.sync();
    } catch (error) {
      return error as Error;
    } finally {
      wire.stream.uncork?.();
    }
    return null;
  }

  private send(wire: Wire, query: NamedQuery, parsed: boolean): void {
    if (!parsed) {
      wire.parse({ text: query.text, name: query.name });
      wire.submittedNamedStatements[query.name] = query.text;
    }
    wire.bind({
      portal: "",
      statement: query.name,
      values: query.values ?? [],
      valueMapper: textValue,
    });
    wire.describe({ type: "P", name: "" });
    wire.execute({ portal: "" });
  }

  handleRowDescription(): void {}

  handleDataRow(message: { fields: Array<string | null> }): void {
    const [op, i, key] = message.fields;
    this.answers[this.firstAnswered ? 1 : 0].push({
      op: Number(op),
      i: Number(i),
      key: key ?? null,
    });
  }

  handleCommandComplete(): void {
    if (this.firstAnswered) return;
    this.firstAnswered = true;
    try {
      this.onFirst(this.answers[0]);
    } catch (error) {
      process.nextTick(() => {
        throw error;
      });
    }
  }

  handleEmptyQuery(): void {}

  handleError(error: Error): void {
    const parse = this.secondParse;
    // (the server skips what follows an error up to the Sync: a second part not yet parsed never will be)
    if (parse && !parse.done) delete parse.wire.submittedNamedStatements[this.second.name];
    this.end({ error, firstAnswered: this.firstAnswered, rows: [] });
  }

  handleReadyForQuery(): void {
    const parse = this.secondParse;
    if (parse) {
      parse.wire.parsedStatements[this.second.name] = this.second.text;
      delete parse.wire.submittedNamedStatements[this.second.name];
    }
    this.end({ error: null, firstAnswered: true, rows: this.answers[1] });
  }

  private end(end: TwoPartEnd): void {
    if (this.ended) return;
    this.ended = true;
    this.secondParse?.wire.removeListener("parseComplete", this.secondParse.listener);
    this.onEnd(end);
  }
}
