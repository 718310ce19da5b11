"""Short articles whose story a publisher's boilerplate or a one-word change decides: the sets of
the same-story review (2026-12-07, F2 and F3) for transforms/stories/'s tests and benchmarks.

An ``Item`` is one article: ``id``, ``text``, ``source``, ``published_at`` (RFC 3339) and
``story``, the id of its true story's first article (its own id for an original). A set is a list
of items in published order; ``truth(items)`` gives each id's true story, ``copies(items)`` the
ids that are real copies. Every set is deterministic (fixed seeds) and needs no network. English
briefs are cut from the BBC News articles (``bbc_dir``: ``NEWSVEC_BBC_DIR``, else
../shared/data/bbc-news); Japanese ones from tools/japanese_stories.ARTICLES; the boilerplate and
the flashes are written for this repository.

``SETS`` (name -> function(bbc_dir) -> items):
- en-briefs: 50 briefs (the first 3 sentences, 300-650 chars) of source ledger + a 600-char
  footer, 40 briefs (1-3 sentences) of courier + a 300-char footer, 8 real copies.
- en-headlines: 40 headlines (an article's first 8 words) of ledger (600-char footer), 40 of
  courier (300-char footer), 8 real copies.
- en-publishers: 25 briefs each of presswire ("About <company>" paragraph), morning (a
  newsletter header at the start), linkpost (a "Related: a | b | c" block), tribune (a line with
  the article's own date and time, then a fixed footer); 8 real copies.
- ja-briefs: 20 briefs (headline + 1-3 sentences) each of minato (著作権表示 and a dated line)
  and hikari (会社概要「…株式会社について」); 6 real copies.
- ja-headlines: 20 headlines each of haishin (配信元) and kanren (関連記事リンク); 6 real copies.
- en-flash-different, ja-flash-different: pairs of flashes whose facts differ (``DIFFERENT_EN``,
  ``DIFFERENT_JA``): two stories a pair.
- en-flash-same, ja-flash-same: pairs of one flash and a trivial edit of it (``SAME_EN``,
  ``SAME_JA``): one story a pair.
Every original of the footer sets is its own story; a real copy is a brief or headline reprinted
by another source of the set (that source's boilerplate, a wire prefix, a typo in a long word or
digits swapped to the other width), a story of its original.
"""
from __future__ import annotations

import csv
import datetime as dt
import os
import random
import re
import unicodedata
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Sequence

from pipeline.config import REPO_ROOT
from tools import japanese_stories

BBC_DIR = Path(os.environ.get("NEWSVEC_BBC_DIR")
               or REPO_ROOT.parent / "shared" / "data" / "bbc-news")
START = dt.datetime(2026, 12, 1, 6, 0, tzinfo=dt.timezone.utc)
BRIEF_CHARS = (300, 650)
HEADLINE_WORDS = 8


class Item(NamedTuple):
    id: str
    text: str
    source: str
    published_at: str
    story: str


class Publisher(NamedTuple):
    """A source and what it prints around every article: ``head`` before, ``dated`` (a strftime
    format of the publication time) and ``foot`` after."""

    source: str
    head: str = ""
    foot: str = ""
    dated: str = ""

    def dress(self, text: str, when: dt.datetime) -> str:
        parts = [self.head, text, when.strftime(self.dated) if self.dated else "", self.foot]
        return "\n\n".join(part for part in parts if part)


FOOTER_600 = (
    "© 2026 The Ledger Media Group Ltd. All rights reserved. This article is for general "
    "information only and does not constitute financial, legal or investment advice. The Ledger "
    "Media Group and its affiliates accept no liability for any loss arising from reliance on its "
    "contents. Reproduction, redistribution or storage of this material in any form is prohibited "
    "without prior written permission. Views expressed by contributors are their own. Prices and "
    "figures quoted may be delayed. To report an error, write to corrections@ledger.example. For "
    "licensing and reprint requests, visit ledger.example/licensing.")
FOOTER_300 = (
    "Copyright 2026 Courier Newspapers. All rights reserved. This material may not be published, "
    "broadcast, rewritten or redistributed without permission. The Courier is not responsible for "
    "the content of external sites. Sign up for our free daily newsletter at courier.example/daily "
    "and never miss a story.")
ABOUT = (
    "About Northwind Media Group\nNorthwind Media Group Inc. (NASDAQ: NWMG) distributes news, "
    "press releases and market data to more than 4,000 newsrooms and trading desks in 60 "
    "countries. Founded in 2009 and headquartered in Austin, Texas, it employs 1,200 people. For "
    "more information, visit northwind.example.\nMedia contact: press@northwind.example")
NEWSLETTER = (
    "The Morning Brief | Your five-minute guide to the day's news, delivered every weekday before "
    "breakfast. Forwarded this email? Sign up free at morningbrief.example. Today's edition is "
    "supported by our members.")
RELATED = (
    "Related: Markets live: shares, bonds and currencies | Your money: what the budget means for "
    "you | Weather: the week ahead | Podcast: The Daily Briefing | Most read today")
TRIBUNE_FOOT = (
    "Tribune Media Syndicate. Distributed by Tribune Content Agency. All rights reserved; no part "
    "of this story may be reproduced without permission.")
JA_COPYRIGHT = (
    "Copyright © みなと新聞社 All rights reserved.\n"
    "掲載の記事・写真・図表などの無断転載を禁じます。"
    "著作権はみなと新聞社またはその情報提供者に帰属します。")
JA_ABOUT = (
    "■ひかり通信株式会社について\nひかり通信株式会社は、東京都千代田区に本社を置くニュース配信会社です。"
    "全国の新聞社や放送局と提携し、国内外のニュースを２４時間配信しています。\n"
    "【本件に関するお問い合わせ】ひかり通信株式会社　広報部　press@hikari.example")
JA_SOURCE = (
    "配信元：あさひネット通信。この記事は配信元から提供を受けて掲載しています。"
    "内容に関するお問い合わせは配信元までお願いします。")
JA_RELATED = ("関連記事：【天気】週末の全国の天気｜【経済】今日の為替と株価｜"
              "【特集】暮らしのお金の話｜【動画】ニュース解説")

LEDGER = Publisher("ledger", foot=FOOTER_600)
COURIER = Publisher("courier", foot=FOOTER_300)
PRESSWIRE = Publisher("presswire", foot=ABOUT)
MORNING = Publisher("morning", head=NEWSLETTER)
LINKPOST = Publisher("linkpost", foot=RELATED)
TRIBUNE = Publisher("tribune", dated="Published %d %B %Y, %H:%M GMT", foot=TRIBUNE_FOOT)
MINATO = Publisher("minato", dated="%Y年%m月%d日 %H時%M分 更新", foot=JA_COPYRIGHT)
HIKARI = Publisher("hikari", foot=JA_ABOUT)
HAISHIN = Publisher("haishin", foot=JA_SOURCE)
KANREN = Publisher("kanren", foot=JA_RELATED)

EN_PREFIXES = ("LONDON (Reuters) - ", "(AP) - ", "By Staff Reporter\n", "EXCLUSIVE: ")
JA_PREFIXES = ("【共同】", "（時事）", "【ワシントン時事】", "ニュース提供：共同通信\n")


# -- English briefs and headlines from the BBC articles -----------------------------------------

_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[\"'A-Z0-9])")


def bbc_articles(bbc_dir: Path = BBC_DIR, split: str = "test") -> list[str]:
    """The articles of ``<split>.csv`` in file order, each first 80 characters once (the corpus
    holds some articles twice)."""
    with open(Path(bbc_dir) / f"{split}.csv", newline="", encoding="utf-8") as f:
        rows = [row["text"] for row in csv.DictReader(f)]
    seen: set[str] = set()
    return [text for text in rows if not (text[:80] in seen or seen.add(text[:80]))]


def brief(text: str, sentences: Sequence[int] = (3,)) -> str | None:
    """The first n sentences, for the largest n of ``sentences`` whose brief is 300-650 chars."""
    parts = _SENTENCE.split(text)
    for n in sorted(sentences, reverse=True):
        cut = " ".join(parts[:n])
        if n <= len(parts) and BRIEF_CHARS[0] <= len(cut) <= BRIEF_CHARS[1]:
            return cut
    return None


def headline(text: str) -> str:
    """The article's first eight words (the BBC text runs headline and lead together)."""
    return " ".join(text.split()[:HEADLINE_WORDS])


def take(texts: Iterator[str], n: int, make: Callable[[str], str | None]) -> list[str]:
    """``n`` cuts ``make`` gives (None: the text does not fit), consuming ``texts``: groups taken
    from one iterator never share an article, nor a cut one already taken (same first 40
    chars)."""
    out: list[str] = []
    for text in texts:
        cut = make(text)
        if cut and all(cut[:40] != other[:40] for other in out):
            out.append(cut)
            if len(out) == n:
                return out
    raise ValueError(f"only {len(out)} of {n} articles fit")


# -- dressing, reprinting, sets ------------------------------------------------------------------

def rfc3339(when: dt.datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


_WIDTH = str.maketrans("0123456789０１２３４５６７８９", "０１２３４５６７８９0123456789")


def light_edit(text: str, rng: random.Random, japanese: bool = False) -> str:
    """A trivial edit: Japanese, every digit to the other width; English, two inner letters of
    a word of 8 letters or more swapped (a typo)."""
    if japanese:
        return text.translate(_WIDTH)
    words = [m for m in re.finditer(r"[A-Za-z]{8,}", text)]
    if not words:
        return text
    m = rng.choice(words)
    i = m.start() + rng.randrange(1, len(m.group()) - 2)
    return text[:i] + text[i + 1] + text[i] + text[i + 2:]


def reprint(original: Item, body: str, publisher: Publisher, id_: str, when: dt.datetime,
            rng: random.Random, japanese: bool = False) -> Item:
    """``body`` (the original's text before its boilerplate) as ``publisher`` reprints it: a wire
    prefix, a light edit, the publisher's own boilerplate; the original's story."""
    prefix = rng.choice(JA_PREFIXES if japanese else EN_PREFIXES)
    text = publisher.dress(prefix + light_edit(body, rng, japanese), when)
    return Item(id_, text, publisher.source, rfc3339(when), original.story)


def dressed_set(name: str, groups: Sequence[tuple[Publisher, Sequence[str]]], copies: int,
                seed: int, japanese: bool = False) -> list[Item]:
    """Each group's texts dressed by its publisher, the groups interleaved a minute apart, then
    ``copies`` real copies (originals drawn from every group in turn, each reprinted by the next
    group's publisher 30 s to a few minutes after it), all in published order."""
    rng = random.Random(seed)
    items, bodies = [], {}
    for i in range(max(len(texts) for _, texts in groups)):
        for publisher, texts in groups:
            if i < len(texts):
                when = START + dt.timedelta(minutes=len(items))
                id_ = f"{name}-{publisher.source}-{i:02d}"
                items.append(Item(id_, publisher.dress(texts[i], when), publisher.source,
                                  rfc3339(when), id_))
                bodies[id_] = texts[i]
    originals = len(items)
    for j in range(copies):
        g = j % len(groups)
        pool = [item for item in items[:originals] if item.source == groups[g][0].source]
        original = rng.choice(pool)
        when = dt.datetime.fromisoformat(original.published_at.replace("Z", "+00:00"))
        when += dt.timedelta(seconds=30 + 60 * rng.randrange(5))
        other = groups[(g + 1) % len(groups)][0]
        items.append(reprint(original, bodies[original.id], other,
                             f"{name}-{other.source}-copy-{j:02d}", when, rng, japanese))
    return sorted(items, key=lambda item: (item.published_at, item.id))


def en_briefs(bbc_dir: Path = BBC_DIR) -> list[Item]:
    """Short BBC briefs under a 600-char (ledger) and a 300-char (courier) footer."""
    texts = iter(bbc_articles(bbc_dir, "test"))
    ledger = take(texts, 50, lambda t: brief(t, (3,)))
    courier = take(texts, 40, lambda t: brief(t, (1, 2, 3)))
    return dressed_set("en-briefs", [(LEDGER, ledger), (COURIER, courier)], 8, seed=1)


def en_headlines(bbc_dir: Path = BBC_DIR) -> list[Item]:
    """Eight-word headlines alone under a 600-char (ledger) and a 300-char (courier) footer."""
    texts = iter(bbc_articles(bbc_dir, "val"))
    return dressed_set("en-headlines", [(LEDGER, take(texts, 40, headline)),
                                        (COURIER, take(texts, 40, headline))], 8, seed=2)


def en_publishers(bbc_dir: Path = BBC_DIR) -> list[Item]:
    """Briefs under four other kinds of boilerplate: an "About" paragraph, a newsletter header at
    the start, a related-links block, a per-article date line and a footer."""
    texts = iter(bbc_articles(bbc_dir, "train"))
    groups = [(p, take(texts, 25, lambda t: brief(t, (1, 2, 3))))
              for p in (PRESSWIRE, MORNING, LINKPOST, TRIBUNE)]
    return dressed_set("en-publishers", groups, 8, seed=3)


def ja_brief(article: japanese_stories.Article, sentences: int) -> str:
    body = [s + "。" for s in article.body.split("。") if s]
    return article.headline + "\n" + "".join(body[:sentences])


def ja_briefs(bbc_dir: Path = BBC_DIR) -> list[Item]:
    """Japanese briefs (headline + 1-3 sentences) under 著作権表示 with a dated line (minato) and
    a 会社概要 paragraph (hikari)."""
    briefs = [ja_brief(a, 1 + i % 3) for i, a in enumerate(japanese_stories.ARTICLES)]
    return dressed_set("ja-briefs", [(MINATO, briefs[0::2]), (HIKARI, briefs[1::2])], 6,
                       seed=4, japanese=True)


def ja_headlines(bbc_dir: Path = BBC_DIR) -> list[Item]:
    """Japanese headlines alone under 配信元 (haishin) and 関連記事 links (kanren)."""
    heads = [a.headline for a in japanese_stories.ARTICLES]
    return dressed_set("ja-headlines", [(HAISHIN, heads[0::2]), (KANREN, heads[1::2])], 6,
                       seed=5, japanese=True)


# -- flashes -------------------------------------------------------------------------------------

class Pair(NamedTuple):
    kind: str
    first: str
    second: str


REVIEW_PAIRS = (  # F3's pairs, with different facts
    Pair("verb", "Fed raises interest rates by 25 basis points",
         "Fed cuts interest rates by 25 basis points"),
    Pair("person", "Trump wins Iowa caucus, AP projects", "Haley wins Iowa caucus, AP projects"),
    Pair("verb", "Oil prices rise as OPEC+ agrees to extend output cuts",
         "Oil prices fall as OPEC+ agrees to extend output cuts"),
    Pair("number", "Ukraine says air defences shot down 20 of 25 drones overnight",
         "Ukraine says air defences shot down 31 of 35 drones overnight"),
    Pair("sex", "Man arrested after stabbing in Manchester city centre",
         "Woman arrested after stabbing in Manchester city centre"),
)
_P = Pair
DIFFERENT_EN = REVIEW_PAIRS + (
    _P("verb", "ECB raises deposit rate to 4%", "ECB cuts deposit rate to 4%"),
    _P("negation", "Biden will attend the G7 summit in Italy",
       "Biden will not attend the G7 summit in Italy"),
    _P("place", "Magnitude 6.1 earthquake strikes off the coast of Chile",
       "Magnitude 6.1 earthquake strikes off the coast of Peru"),
    _P("number", "Apple shares jump 4% after record iPhone sales",
       "Apple shares jump 9% after record iPhone sales"),
    _P("roles", "Sinner beats Alcaraz in Wimbledon final",
       "Alcaraz beats Sinner in Wimbledon final"),
    _P("number", "Death toll in Turkey earthquake rises to 1,200",
       "Death toll in Turkey earthquake rises to 2,300"),
    _P("verb", "Sterling rises against the dollar after jobs data",
       "Sterling falls against the dollar after jobs data"),
    _P("verb", "Court upholds ban on protest camp outside parliament",
       "Court overturns ban on protest camp outside parliament"),
    _P("sex", "Boy, 14, rescued from river in Leeds", "Girl, 14, rescued from river in Leeds"),
    _P("place", "Flood warnings issued for Cornwall after heavy rain",
       "Flood warnings issued for Cumbria after heavy rain"),
    _P("number", "Unemployment falls to 3.9% in March", "Unemployment falls to 4.2% in March"),
    _P("verb", "Microsoft to buy gaming studio for $2bn",
       "Microsoft to sell gaming studio for $2bn"),
    _P("person", "Macron names Barnier as prime minister", "Macron names Bayrou as prime minister"),
    _P("negation", "Union says rail strike will go ahead on Monday",
       "Union says rail strike will not go ahead on Monday"),
    _P("place", "Gunman opens fire at shopping centre in Dallas",
       "Gunman opens fire at shopping centre in Denver"),
    _P("number", "Rail fares to rise by 4.9% in January", "Rail fares to rise by 8.5% in January"),
    _P("verb", "Bitcoin climbs above $70,000 for first time",
       "Bitcoin drops below $70,000 for first time"),
    _P("person", "Police name Sarah Jones as victim of Bristol crash",
       "Police name Emma Jones as victim of Bristol crash"),
    _P("entity", "Liverpool sign Dutch midfielder for £35m",
       "Chelsea sign Dutch midfielder for £35m"),
    _P("negation", "Nurse found guilty of murder at Old Bailey",
       "Nurse found not guilty of murder at Old Bailey"),
    _P("number", "Storm leaves 50,000 homes without power",
       "Storm leaves 5,000 homes without power"),
    _P("place", "Wildfire forces evacuations near Athens",
       "Wildfire forces evacuations near Lisbon"),
    _P("verb", "Parliament approves assisted dying bill", "Parliament rejects assisted dying bill"),
    _P("entity", "Toyota recalls 120,000 cars over airbag fault",
       "Honda recalls 120,000 cars over airbag fault"),
    _P("sex", "Father charged after baby found injured in Leicester",
       "Mother charged after baby found injured in Leicester"),
)
SAME_EN = (
    _P("wire", "Japan's Nikkei closes at record high",
       "(Reuters) - Japan's Nikkei closes at record high"),
    _P("dateline", "Ceasefire talks resume in Cairo",
       "CAIRO (AP) - Ceasefire talks resume in Cairo"),
    _P("case", "Apple Unveils New iPhone With Satellite Messaging",
       "Apple unveils new iPhone with satellite messaging"),
    _P("punctuation", "Storm Ciaran: schools closed, trains cancelled",
       "Storm Ciaran - schools closed; trains cancelled"),
    _P("spelling", "Police organise search for missing walker in Snowdonia",
       "Police organize search for missing walker in Snowdonia"),
    _P("spelling", "Fire breaks out at Madrid shopping centre",
       "Fire breaks out at Madrid shopping center"),
    _P("typo", "Government announces emergency funding for hospitals",
       "Government announces emergancy funding for hospitals"),
    _P("credit", "Wildfire spreads north of Los Angeles",
       "Wildfire spreads north of Los Angeles - AP"),
    _P("width", "Nasdaq gains 2% as chip stocks rally", "Nasdaq gains ２% as chip stocks rally"),
    _P("wire", "BREAKING: Prime minister resigns after confidence vote",
       "Prime minister resigns after confidence vote"),
    _P("byline", "Eurozone inflation slows to 2.4% in November",
       "Eurozone inflation slows to 2.4% in November. Reporting by Jan Strupczewski"),
    _P("spelling", "Defence ministers meet in Brussels over air defence",
       "Defense ministers meet in Brussels over air defense"),
    _P("typo", "Scientists discover ancient settlement beneath Amazon rainforest",
       "Scientists discover ancient settlment beneath Amazon rainforest"),
    _P("case", "OPEC+ AGREES TO EXTEND OUTPUT CUTS INTO 2025",
       "OPEC+ agrees to extend output cuts into 2025"),
    _P("punctuation", 'Minister says "no plans" to raise fuel duty',
       "Minister says 'no plans' to raise fuel duty"),
    _P("wire", "(AP) - Hurricane Milton makes landfall in Florida",
       "Hurricane Milton makes landfall in Florida"),
    _P("spelling", "Council to analyse traffic data before cycle lane vote",
       "Council to analyze traffic data before cycle lane vote"),
    _P("dateline", "TOKYO (Kyodo) - Toyota recalls 280,000 cars in Japan",
       "Toyota recalls 280,000 cars in Japan"),
    _P("punctuation", "Airline cancels 1,200 flights amid strike",
       "Airline cancels 1200 flights amid strike"),
    _P("typo", "Parliament approves controversial immigration legislation",
       "Parliament approves controversal immigration legislation"),
    _P("credit", "Lava flows reach town in Iceland", "Lava flows reach town in Iceland | Reuters"),
    _P("spelling", "Colour photos of Mars released by rover team",
       "Color photos of Mars released by rover team"),
    _P("case", "Nvidia becomes world's most valuable company.",
       "NVIDIA becomes world's most valuable company"),
    _P("wire", "EXCLUSIVE-Chinese exports beat forecasts in October",
       "Chinese exports beat forecasts in October"),
    _P("wire", "Tokyo stocks fall 1.5% at the open",
       "(Bloomberg) -- Tokyo stocks fall 1.5% at the open"),
    _P("typo", "Referendum participation higher than expected in Scotland",
       "Referendum participaiton higher than expected in Scotland"),
)
DIFFERENT_JA = (
    _P("verb", "日銀が利上げを決定", "日銀が利下げを決定"),
    _P("verb", "日銀、政策金利を０．２５％引き上げ", "日銀、政策金利を０．２５％引き下げ"),
    _P("verb", "日経平均が大幅上昇、終値は３万９０００円台",
       "日経平均が大幅下落、終値は３万９０００円台"),
    _P("person", "自民党総裁選、石破氏が勝利", "自民党総裁選、高市氏が勝利"),
    _P("number", "東京都で新たに３５２人が感染", "東京都で新たに５２３人が感染"),
    _P("place", "震度５強の地震、石川県で観測", "震度５強の地震、福島県で観測"),
    _P("negation", "政府、消費税率を引き上げる方針", "政府、消費税率を引き上げない方針"),
    _P("sex", "男性が刺され重傷、大阪市のビル", "女性が刺され重傷、大阪市のビル"),
    _P("verb", "円安が進み１ドル＝１５０円台に", "円高が進み１ドル＝１５０円台に"),
    _P("verb", "参院本会議で改正法案を可決", "参院本会議で改正法案を否決"),
    _P("verb", "サッカー日本代表、ドイツに勝利", "サッカー日本代表、ドイツに敗れる"),
    _P("number", "台風１０号が九州に上陸", "台風１１号が九州に上陸"),
    _P("verb", "訪日客数、前年比２０％増", "訪日客数、前年比２０％減"),
    _P("number", "大谷翔平が５０号本塁打", "大谷翔平が５１号本塁打"),
    _P("place", "東海道新幹線、東京―新大阪間で運転見合わせ",
       "東北新幹線、東京―仙台間で運転見合わせ"),
    _P("verb", "強盗事件で２０代の男を逮捕", "強盗事件で２０代の男を釈放"),
    _P("verb", "隅田川花火大会、予定通り開催へ", "隅田川花火大会、中止へ"),
    _P("verb", "県知事が辞任を表明", "県知事が続投を表明"),
    _P("number", "最低賃金、全国平均１０５５円に", "最低賃金、全国平均１００４円に"),
    _P("negation", "首相、年内の衆院解散を否定", "首相、年内の衆院解散を示唆"),
    _P("verb", "トヨタ、今期の業績予想を上方修正", "トヨタ、今期の業績予想を下方修正"),
    _P("place", "大雨特別警報、熊本県に発表", "大雨特別警報、鹿児島県に発表"),
    _P("verb", "東京地裁、被告に無罪判決", "東京地裁、被告に有罪判決"),
    _P("verb", "電気料金、来月から値上げ", "電気料金、来月から値下げ"),
    _P("number", "能登の地震、死者は１２人に", "能登の地震、死者は２１人に"),
    _P("person", "名人戦、藤井名人が勝利", "名人戦、豊島九段が勝利"),
    _P("person", "芥川賞に山田太郎さん", "芥川賞に佐藤花子さん"),
)
SAME_JA = (
    _P("wire", "日銀が追加利上げを決定", "【共同】日銀が追加利上げを決定"),
    _P("credit", "政府、防災庁の新設を閣議決定", "政府、防災庁の新設を閣議決定（共同）"),
    _P("width", "日経平均、終値は３万８５００円", "日経平均、終値は3万8500円"),
    _P("punctuation", "首相、衆院解散を表明", "首相　衆院解散を表明"),
    _P("punctuation", "官房長官「極めて遺憾」と表明", "官房長官『極めて遺憾』と表明"),
    _P("dateline", "【ワシントン時事】米大統領、来月中国訪問へ", "米大統領、来月中国訪問へ"),
    _P("spelling", "子供の貧困率、過去最低に", "子どもの貧困率、過去最低に"),
    _P("spelling", "最低賃金の引き上げを答申", "最低賃金の引上げを答申"),
    _P("spelling", "コンピューターウイルスの被害が拡大", "コンピュータウイルスの被害が拡大"),
    _P("width", "ＪＲ東日本、来春に運賃を改定", "JR東日本、来春に運賃を改定"),
    _P("wire", "【速報】大谷翔平が５０号本塁打", "大谷翔平が５０号本塁打"),
    _P("spelling", "バイオリニストの山田さん、国際コンクールで優勝",
       "ヴァイオリニストの山田さん、国際コンクールで優勝"),
    _P("credit", "円相場、一時１ドル＝１６０円台", "円相場、一時１ドル＝１６０円台（時事）"),
    _P("typo", "災害時の避難シミュレーションを公開", "災害時の避難シュミレーションを公開"),
    _P("spelling", "新型ウイルスの感染者が増加", "新型ウィルスの感染者が増加"),
    _P("punctuation", "北海道で震度４の地震", "北海道で震度４の地震。"),
    _P("byline", "札幌で初雪を観測、平年より５日遅く",
       "札幌で初雪を観測、平年より５日遅く（記者　山田太郎）"),
    _P("punctuation", "東京株式市場　日経平均が反落", "東京株式市場、日経平均が反落"),
    _P("wire", "ニュース提供：共同通信\n関西空港で滑走路を一時閉鎖", "関西空港で滑走路を一時閉鎖"),
    _P("spelling", "新型ワクチン、来月から接種できる見通し",
       "新型ワクチン、来月から接種出来る見通し"),
    _P("width", "ＮＨＫ、受信料を１割値下げ", "NHK、受信料を1割値下げ"),
    _P("spelling", "大手銀行でサーバー障害、ＡＴＭが停止", "大手銀行でサーバ障害、ＡＴＭが停止"),
    _P("wire", "【独自】文部科学省、大学入試の日程見直しへ", "文部科学省、大学入試の日程見直しへ"),
    _P("dateline", "【ロンドン共同】英中銀が政策金利を据え置き", "英中銀が政策金利を据え置き"),
    _P("width", "上場企業の純利益、２年連続で最高", "上場企業の純利益、2年連続で最高"),
    _P("punctuation", "羽田空港で航空機が接触事故、けが人なし",
       "羽田空港で航空機が接触事故　けが人なし"),
)


def flash_set(name: str, pairs: Sequence[Pair], same: bool) -> list[Item]:
    """Pair i: the first flash at START + 2i minutes (source wire), the second 30 s later (source
    site): of the first's story when ``same``, else its own."""
    items = []
    for i, pair in enumerate(pairs):
        when = START + dt.timedelta(minutes=2 * i)
        first, second = f"{name}-{i:02d}-a", f"{name}-{i:02d}-b"
        items += [Item(first, pair.first, "wire", rfc3339(when), first),
                  Item(second, pair.second, "site", rfc3339(when + dt.timedelta(seconds=30)),
                       first if same else second)]
    return items


SETS: dict[str, Callable[[Path], list[Item]]] = {
    "en-briefs": en_briefs,
    "en-headlines": en_headlines,
    "en-publishers": en_publishers,
    "ja-briefs": ja_briefs,
    "ja-headlines": ja_headlines,
    "en-flash-different": lambda _: flash_set("en-flash-different", DIFFERENT_EN, same=False),
    "en-flash-same": lambda _: flash_set("en-flash-same", SAME_EN, same=True),
    "ja-flash-different": lambda _: flash_set("ja-flash-different", DIFFERENT_JA, same=False),
    "ja-flash-same": lambda _: flash_set("ja-flash-same", SAME_JA, same=True),
}


def truth(items: Sequence[Item]) -> dict[str, str]:
    """Each item's id -> its true story."""
    return {item.id: item.story for item in items}


def copies(items: Sequence[Item]) -> dict[str, str]:
    """The real copies: id -> the story they belong to."""
    return {item.id: item.story for item in items if item.story != item.id}


def numbers(text: str) -> list[str]:
    """The numbers of a text (NFKC, thousands commas dropped), in order."""
    return re.findall(r"\d+(?:\.\d+)?", unicodedata.normalize("NFKC", text).replace(",", ""))
